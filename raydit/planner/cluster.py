"""What the planner may use: nodes, their device type and count, and the links.

Built from `--gpus N --gpu-type T` (`ClusterSpec.uniform`), a YAML file
(`ClusterSpec.from_yaml`), a dict (`ClusterSpec.from_dict`), or by the Ray runtime from the
live cluster (`ClusterSpec(nodes=[NodeSpec(...)])`). YAML layout (see cluster/*.yaml):

    network: {gb_s: 50, latency_us: 5}     # between nodes, per GPU, one direction
    gpu_types:                               # optional: types not in the built-in table
      - {name: MI300X, memory_gb: 192, tflops: 1307, efficiency: 0.3, link_gb_s: 448, link_kind: nvlink}
        # optional per type (hardware.DeviceType): activation_bytes: 2, per_node: 8,
        # attention_efficiency: [[64, 0.25], [128, 0.3]]  (head dim, fraction of tflops; the
        # LSE kernel of ring > 1), plain_attention_efficiency: the same for ring 1
    nodes:
      - {name: a, gpu_type: H100, count: 8}
      - {name: b, gpu_type: L40S, count: 4, link_gb_s: 25}   # link overrides the type's
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from raydit.planner.hardware import (
    DEFAULT_NETWORK_GB_S,
    DEFAULT_NETWORK_LATENCY_US,
    DEVICE_TYPES,
    DeviceType,
    finite_number,
    device_type,
)


# The most devices one plan covers: the planner walks layouts per node and per replica, and a
# cluster of 16384 single-GPU nodes plans in about 12 s on one core.
MAX_DEVICES = 16384


def _check_device_count(count: int, what: str) -> None:
    if count > MAX_DEVICES:
        raise ValueError(f"{what} more than the {MAX_DEVICES} devices raydit plans for at once; plan a part of the "
                         "cluster (the plan for a part repeats: replicas are independent)")


@dataclass(frozen=True)
class NodeSpec:
    """One node: `count` devices of `gpu_type` (a name or a DeviceType).

    link_gb_s / link_kind: override the device type's intra-node link (None: the type's).
    """

    name: str
    gpu_type: str | DeviceType
    count: int
    link_gb_s: float | None = None
    link_kind: str | None = None

    def __post_init__(self):
        if isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 1:
            raise ValueError(f"node {self.name!r}: count must be a positive integer, got {self.count!r}")
        if not isinstance(self.gpu_type, DeviceType):
            object.__setattr__(self, "gpu_type", device_type(self.gpu_type))
        if self.link_gb_s is not None and not (finite_number(self.link_gb_s) and self.link_gb_s > 0):
            raise ValueError(f"node {self.name!r}: link_gb_s must be a number > 0, got {self.link_gb_s!r}")
        if self.link_kind is not None and self.link_kind not in ("nvlink", "pcie", "shm"):
            raise ValueError(f"node {self.name!r}: link_kind {self.link_kind!r} is not nvlink, pcie or shm")

    @property
    def device(self) -> DeviceType:
        return self.gpu_type  # type: ignore[return-value]

    @property
    def intra_gb_s(self) -> float:
        return self.link_gb_s if self.link_gb_s is not None else self.device.link_gb_s

    @property
    def intra_kind(self) -> str:
        return self.link_kind or self.device.link_kind

    def to_dict(self) -> dict:
        return {"name": self.name, "gpu_type": self.device.name, "count": self.count,
                "link_gb_s": self.intra_gb_s, "link_kind": self.intra_kind}


@dataclass(frozen=True)
class ClusterSpec:
    """Nodes plus the network between them (per GPU, GB/s in one direction)."""

    nodes: tuple[NodeSpec, ...] = field(default_factory=tuple)
    network_gb_s: float = DEFAULT_NETWORK_GB_S
    network_latency_us: float = DEFAULT_NETWORK_LATENCY_US

    def __post_init__(self):
        object.__setattr__(self, "nodes", tuple(self.nodes))
        if not self.nodes:
            raise ValueError("a cluster needs at least one node with at least one GPU")
        names = [n.name for n in self.nodes]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"node names must be unique; repeated: {', '.join(dup)}")
        _check_device_count(self.total, f"the cluster has {self.total} devices,")
        for key, least in (("gb_s", "> 0"), ("latency_us", ">= 0")):
            value = getattr(self, f"network_{key}")
            if not finite_number(value) or value < 0 or (value == 0 and least == "> 0"):
                raise ValueError(f"network {key} {value!r} must be a number {least}")
            object.__setattr__(self, f"network_{key}", float(value))

    @property
    def total(self) -> int:
        return sum(n.count for n in self.nodes)

    @property
    def types(self) -> list[str]:
        """Device type names present, in first-seen order."""
        seen: list[str] = []
        for n in self.nodes:
            if n.device.name not in seen:
                seen.append(n.device.name)
        return seen

    def only(self, type_name: str) -> "ClusterSpec":
        """The sub-cluster made of one device type's nodes."""
        return ClusterSpec(tuple(n for n in self.nodes if n.device.name == type_name),
                           self.network_gb_s, self.network_latency_us)

    @classmethod
    def uniform(cls, n: int, gpu_type: str | DeviceType = "H100", per_node: int | None = None,
                **network) -> "ClusterSpec":
        """`n` devices of one type, `per_node` to a node (default: the type's usual node)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"gpus must be a positive integer, got {n!r}")
        _check_device_count(n, f"gpus {n} is")  # before a node is made for each
        dev = gpu_type if isinstance(gpu_type, DeviceType) else device_type(gpu_type)
        per_node = dev.per_node if per_node is None else per_node
        if isinstance(per_node, bool) or not isinstance(per_node, int) or per_node < 1:
            raise ValueError(f"per_node must be a positive integer, got {per_node!r}")
        nodes, left, i = [], n, 0
        while left:
            take = min(per_node, left)
            nodes.append(NodeSpec(f"node{i}", dev, take))
            left -= take
            i += 1
        return cls(tuple(nodes), **network)

    @classmethod
    def from_dict(cls, data: dict, source: str = "cluster") -> "ClusterSpec":
        """Build from the YAML layout in the module docstring; ValueError names the bad entry."""
        if not isinstance(data, dict):
            raise ValueError(f"{source}: expected a mapping with a 'nodes' list")
        unknown = set(data) - {"nodes", "network", "gpu_types", "name", "description"}
        if unknown:
            raise ValueError(f"{source}: unknown keys {', '.join(sorted(unknown))}; "
                             "known: nodes, network, gpu_types, name, description")
        custom: dict[str, DeviceType] = {}
        types_in = data.get("gpu_types") or []
        if not isinstance(types_in, list):
            raise ValueError(f"{source}: 'gpu_types' must be a list of mappings")
        for i, t in enumerate(types_in):
            if not isinstance(t, dict):
                raise ValueError(f"{source}: gpu_types[{i}] must be a mapping")
            try:
                dt = DeviceType(**t)
            except TypeError as exc:
                raise ValueError(f"{source}: gpu_types[{i}]: {exc}") from None
            except ValueError as exc:
                raise ValueError(f"{source}: gpu_types[{i}]: {exc}") from None
            if dt.name.lower() in custom:
                raise ValueError(f"{source}: gpu_types[{i}]: {dt.name!r} is given twice (names are case-blind)")
            custom[dt.name.lower()] = dt
        nodes_in = data.get("nodes")
        if not isinstance(nodes_in, list) or not nodes_in:
            raise ValueError(f"{source}: 'nodes' must be a non-empty list of {{name, gpu_type, count}}")
        nodes = []
        for i, nd in enumerate(nodes_in):
            if not isinstance(nd, dict):
                raise ValueError(f"{source}: nodes[{i}] must be a mapping with gpu_type and count")
            extra = set(nd) - {"name", "gpu_type", "count", "link_gb_s", "link_kind"}
            if extra:
                raise ValueError(f"{source}: nodes[{i}]: unknown keys {', '.join(sorted(extra))}")
            if "gpu_type" not in nd or "count" not in nd:
                raise ValueError(f"{source}: nodes[{i}] needs gpu_type and count")
            t = nd["gpu_type"]
            dev = custom.get(str(t).lower()) or device_type(t)
            try:
                nodes.append(NodeSpec(str(nd.get("name", f"node{i}")), dev, nd["count"],
                                      nd.get("link_gb_s"), nd.get("link_kind")))
            except ValueError as exc:
                raise ValueError(f"{source}: nodes[{i}]: {exc}") from None
        net = data.get("network") or {}
        if not isinstance(net, dict) or set(net) - {"gb_s", "latency_us"}:
            raise ValueError(f"{source}: 'network' must be a mapping with gb_s and/or latency_us")
        try:
            return cls(tuple(nodes), net.get("gb_s", DEFAULT_NETWORK_GB_S),
                       net.get("latency_us", DEFAULT_NETWORK_LATENCY_US))
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from None

    @classmethod
    def from_yaml(cls, path) -> "ClusterSpec":
        import yaml  # pyyaml: pure Python, imported only when a file is read

        p = Path(path).expanduser()
        try:
            text = p.read_text()
        except FileNotFoundError:
            raise ValueError(f"cluster file {str(p)!r} does not exist") from None
        except OSError as exc:
            raise ValueError(f"cluster file {str(p)!r}: cannot read ({exc.strerror})") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            where = getattr(exc, "problem_mark", None)
            at = f" at line {where.line + 1}" if where is not None else ""
            problem = getattr(exc, "problem", None) or "invalid YAML"
            raise ValueError(f"cluster file {str(p)!r}: {problem}{at}") from None
        return cls.from_dict(data, source=f"cluster file {str(p)!r}")

    def to_dict(self) -> dict:
        return {"nodes": [n.to_dict() for n in self.nodes],
                "network": {"gb_s": self.network_gb_s, "latency_us": self.network_latency_us},
                "total": self.total}


__all__ = ["NodeSpec", "ClusterSpec", "DEVICE_TYPES"]
