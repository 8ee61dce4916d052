"""The request's options are declared once (raydit.runtime.options): the command lines, the
config files, serve's form, the Engine's keywords and the saved run's keys all come from that
one table. Pure Python: no Ray, no models."""

import argparse
import dataclasses
import inspect

import pytest

from raydit.runtime import options


def _flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions if a.option_strings and a.dest != "help"}


def _parser(command: str) -> argparse.ArgumentParser:
    from raydit.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_each_command_line_flag_is_a_config_key_of_the_same_type(command):
    from raydit.jobconfig import GENERATE_OPTIONS
    from raydit.serve.config import SERVE_OPTIONS

    keys = GENERATE_OPTIONS if command == "generate" else SERVE_OPTIONS
    flags = _flags(_parser(command))
    assert set(flags) - {"config"} == {k for k in keys if k != "loras"}  # loras: a config-file key only
    for key, action in flags.items():
        if key == "config":
            continue
        if isinstance(action, argparse._StoreTrueAction):
            assert keys[key] is bool, key
        elif isinstance(action, argparse._AppendAction):
            assert keys[key] is list, key
        elif keys[key] is list:  # a list given once, its entries separated by commas (--sigmas)
            assert action.type is options.comma_list, key
        else:
            assert (action.type or str) is keys[key], key


def test_an_option_both_commands_take_is_parsed_alike_by_both():
    gen, srv = _flags(_parser("generate")), _flags(_parser("serve"))
    shared = set(gen) & set(srv) - {"config"}
    assert {"model", "device", "cfg", "cache", "lora", "compile", "fuse_lora"} <= shared
    for key in shared:
        a, b = gen[key], srv[key]
        assert (type(a), a.type, a.choices, a.metavar, a.option_strings[0]) == \
            (type(b), b.type, b.choices, b.metavar, b.option_strings[0]), key


def test_engine_keywords_submit_keywords_and_the_request_are_one_table():
    from raydit.models.requests import GenerationRequest
    from raydit.runtime.engine import Engine, EngineConfig

    engine = list(inspect.signature(Engine).parameters)
    assert engine == [f.name for f in dataclasses.fields(EngineConfig)]
    assert engine[:7] == ["model", "workers", "device", "ulysses", "ring", "cfg", "address"]
    submit = inspect.signature(Engine.submit).parameters
    request = set(submit) - {"self"} - set(options.call_controls())
    assert request == {f.name for f in dataclasses.fields(GenerationRequest)}
    generate = inspect.signature(Engine.generate).parameters
    assert list(generate) == [p for p in submit if p != "tag"]
    assert (generate["progress"].default, submit["progress"].default) == (True, False)
    # The form's raydit fields are submit's keywords.
    from raydit.serve.schema import RAYDIT_FIELDS

    assert set(RAYDIT_FIELDS) <= set(submit)


@pytest.mark.parametrize("entry", [o for o in options.OPTIONS if o.request and not o.control],
                         ids=lambda o: o.request)
def test_every_request_option_is_everywhere_its_entry_says(entry):
    """Nothing here is listed by hand: each request option of the table is a GenerationRequest
    field and a key of its to_dict, a keyword of Engine.submit, a flag and a config-file key of
    the commands that take it, and a field of serve's form that reaches the request, where its
    entry declares a form."""
    from raydit.jobconfig import GENERATE_OPTIONS
    from raydit.models.requests import GenerationRequest
    from raydit.runtime.engine import Engine
    from raydit.serve.config import SERVE_OPTIONS
    from raydit.serve.schema import FORM_REQUEST, VideoCreate

    assert entry.request in {f.name for f in dataclasses.fields(GenerationRequest)}
    request = GenerationRequest(prompt="a cat", num_frames=9, height=16, width=16)
    assert entry.request in request.to_dict()
    assert entry.request in inspect.signature(Engine.submit).parameters
    for command, keys in (("generate", GENERATE_OPTIONS), ("serve", SERVE_OPTIONS)):
        if command not in entry.commands:
            continue
        if entry.in_file:
            assert entry.key in keys, (command, entry.key)
        if entry.on_line:
            assert entry.key in _flags(_parser(command)), (command, entry.key)
        if entry.cli_request:
            given = options.request_kwargs({entry.key: "given"}, command)
            assert given == {entry.request: "given"}, (command, entry.key)
    if entry.form is not None:
        assert entry.form_name in VideoCreate.model_fields and FORM_REQUEST[entry.form_name] == entry.request


def test_a_request_field_without_an_option_is_refused_at_import(monkeypatch):
    """GenerationRequest and the table are held one to one when raydit.runtime.options loads."""
    monkeypatch.setattr(options, "OPTIONS", tuple(o for o in options.OPTIONS if o.request != "true_cfg_scale"))
    with pytest.raises(RuntimeError, match=r"GenerationRequest's fields \['true_cfg_scale'\] have no request option"):
        options._check_request_fields()


@pytest.mark.parametrize("kwargs, needle", [
    ({"device": "tpu"}, "device 'tpu' is not one of auto, cuda, cpu"),
    ({"workers": 0}, "workers 0 must be a positive integer"),
    ({"cfg": True}, "cfg True must be a positive integer"),
    ({"max_batch": 1.5}, "max_batch 1.5 must be a positive integer"),
    ({"replicas": 2, "max_replicas": 1}, r"max_replicas 1 must be an integer >= replicas \(2\)"),
    ({"scale_up_wait_s": float("inf")}, "scale_up_wait_s inf must be a finite number of seconds"),
    ({"grow": "sometimes"}, "grow 'sometimes' is not one of auto, always, never"),
    ({"warmup": 1}, "warmup 1 must be True or False"),
    ({"cache": "deepcache"}, "deepcache"),
    ({"model": 5}, "model 5 must be a built-in model name"),
    ({"model": None}, "model None must be a built-in model name"),
    ({"loras": ["/x"]}, r"loras \['/x'\] must be a mapping of LoRA name -> path"),
    ({"loras": "/x"}, "loras '/x' must be a mapping of LoRA name -> path"),
    ({"loras": 5}, "loras 5 must be a mapping"),
    ({"dtype": "bf16"}, "dtype 'bf16' is not one of float32, float64, bfloat16, float16"),
    ({"step_timeout_s": -5}, "step_timeout_s -5 must be a finite number of seconds > 0"),
    ({"step_timeout_s": float("nan")}, "step_timeout_s nan must be a finite number of seconds > 0"),
    ({"collective_timeout_s": 0}, "collective_timeout_s 0 must be a finite number of seconds > 0"),
    ({"collective_timeout_s": None}, "collective_timeout_s None must be"),
    ({"placement_timeout_s": -1}, "placement_timeout_s -1 must be a finite number of seconds > 0"),
    ({"placement_timeout_s": float("nan")}, "placement_timeout_s nan must be"),
    ({"elastic": "no"}, "elastic 'no' must be True or False"),
    ({"show_plan": "no"}, "show_plan 'no' must be True or False"),
    ({"address": 5}, "address 5 must be a Ray address string"),
    ({"checkpoint_dir": 5}, "checkpoint_dir 5 must be a directory path"),
])
def test_the_engine_config_is_checked_where_it_is_built(kwargs, needle):
    from raydit.runtime.engine import EngineConfig

    with pytest.raises(ValueError, match=needle):
        EngineConfig(**kwargs)
    config = EngineConfig(workers=2, device="cpu")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.workers = 3


def test_engine_keywords_are_refused_before_ray_starts(monkeypatch):
    """Engine(...) refuses a bad keyword in one line from EngineConfig, before the model is
    resolved or Ray is started; the Engine's defaults and usual values pass the checks."""
    import ray

    from raydit.runtime.engine import Engine, EngineConfig

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray was started for an Engine a keyword check should have refused")

    monkeypatch.setattr(ray, "init", no_ray)
    for kwargs in ({"model": 5}, {"loras": ["/x"]}, {"dtype": "bf16"}, {"step_timeout_s": -5}, {"elastic": "no"}):
        with pytest.raises(ValueError) as info:
            Engine(device="cpu", workers=1, **kwargs)
        assert "\n" not in str(info.value)
    config = EngineConfig(dtype="bfloat16", step_timeout_s=5, placement_timeout_s=1.5, elastic=False, show_plan=False,
                          address="auto", checkpoint_dir="/tmp/runs", loras={"style": "/loras/style.safetensors"})
    assert (config.dtype, config.step_timeout_s, config.loras) == ("bfloat16", 5, {"style": "/loras/style.safetensors"})
    default = EngineConfig()
    assert (default.dtype, default.step_timeout_s, default.collective_timeout_s) == (None, None, 30.0)


def test_adding_an_option_is_one_entry(monkeypatch):
    """One entry, and the option is a flag of both commands, a config-file key, an Engine
    keyword with its default and check, and reaches the Engine from the command line."""
    entry = options.Option("demo_mode", commands=("generate", "serve"), choices=("none", "fp8"), engine="demo_mode",
                           default="none", check=options.one_of("none", "fp8"), help="weights in FP8")
    monkeypatch.setattr(options, "OPTIONS", options.OPTIONS + (entry,))
    for command in ("generate", "serve"):
        parser = argparse.ArgumentParser()
        options.add_arguments(parser, command)
        assert parser.parse_args(["--demo-mode", "fp8"]).demo_mode == "fp8"
        assert options.config_types(command)["demo_mode"] is str
        assert options.engine_kwargs({"demo_mode": "fp8"}, command)["demo_mode"] == "fp8"
        assert "demo_mode" not in options.engine_kwargs({}, command)  # the Engine's default holds
    config = options._make_engine_config()
    assert config().demo_mode == "none" and config(demo_mode="fp8").demo_mode == "fp8"
    with pytest.raises(ValueError, match="demo_mode 'int4' is not one of none, fp8"):
        config(demo_mode="int4")


def test_command_options_reach_the_engine_and_its_request():
    opts = {"model": "tiny", "device": "cpu", "json": True, "frames": 9, "steps": 3, "prompt": "a cat",
            "guidance_option": ["stg_scale=0"], "lora_table": {}, "lora_choice": None, "cache": "fbcache",
            "scale_up_wait": 5}
    kw = options.engine_kwargs(opts, "generate")
    assert (kw["model"], kw["device"], kw["frames"], kw["show_plan"], kw["compile"], kw["cache"]) == \
        ("tiny", "cpu", 9, False, False, "fbcache")
    assert "scale_up_wait_s" not in kw  # not a generate option
    assert options.engine_kwargs(opts, "serve")["scale_up_wait_s"] == 5.0
    req = options.request_kwargs(opts, "generate", guidance_options=(("stg_scale", 0),))
    assert req == {"prompt": "a cat", "num_frames": 9, "num_inference_steps": 3,
                   "guidance_options": (("stg_scale", 0),)}  # cache: the Engine's, not the request's
