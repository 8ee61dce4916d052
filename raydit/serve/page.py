"""The page served at `/`: a prompt form, live progress, and a player for the result.

It calls the same /v1 API as any client. The token is typed into the page and kept in
the page's memory only; the HTML carries no secret, so `/` needs no token.
"""

PAGE_HTML = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>raydit</title>
<style>
  body { font: 15px/1.4 system-ui, sans-serif; max-width: 46rem; margin: 2rem auto; padding: 0 1rem; color: #222; }
  h1 { font-size: 1.3rem; }
  label { display: block; margin: .6rem 0 .2rem; font-weight: 600; }
  input, textarea { width: 100%; box-sizing: border-box; padding: .4rem; font: inherit; }
  .row { display: flex; gap: 1rem; } .row > div { flex: 1; }
  button { margin-top: 1rem; padding: .5rem 1.2rem; font: inherit; }
  progress { width: 100%; height: 1.2rem; }
  #status { min-height: 1.4rem; margin: .6rem 0; }
  #status.error { color: #b00020; }
  video { width: 100%; max-height: 30rem; background: #000; margin-top: .6rem; }
</style>
</head>
<body>
<h1>raydit: text to video</h1>
<form id="form" autocomplete="off">
  <label for="token">API token</label>
  <input id="token" type="password" placeholder="the token from the server's --token-file" required>
  <label for="prompt">Prompt</label>
  <textarea id="prompt" rows="3" required placeholder="a red fox running through fresh snow"></textarea>
  <div class="row">
    <div><label for="steps">Steps</label><input id="steps" type="number" min="1" placeholder="server default"></div>
    <div><label for="frames">Frames</label><input id="frames" type="number" min="1" placeholder="server default"></div>
    <div><label for="seed">Seed</label><input id="seed" type="number" min="0" placeholder="random"></div>
  </div>
  <button id="generate" type="submit">Generate</button>
</form>
<div id="status" role="status"></div>
<progress id="progress" max="100" value="0"></progress>
<video id="player" controls muted loop playsinline></video>
<script>
"use strict";
const $ = (id) => document.getElementById(id);
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

async function api(path, options = {}) {
  const headers = Object.assign({}, options.headers || {}, { Authorization: "Bearer " + $("token").value.trim() });
  const response = await fetch(path, Object.assign({}, options, { headers }));
  if (!response.ok) {
    let message = response.statusText;
    try { message = (await response.json()).error.message; } catch (e) {}
    throw new Error(response.status + ": " + message);
  }
  return response;
}

function show(video) {
  $("status").className = "";
  $("status").textContent = video.id + ": " + video.status + " " + video.progress + "%";
  $("progress").value = video.progress;
}

$("form").addEventListener("submit", async (event) => {
  event.preventDefault();
  $("generate").disabled = true;
  $("player").removeAttribute("src");
  $("progress").value = 0;
  try {
    const body = { prompt: $("prompt").value };
    for (const [id, key] of [["steps", "num_inference_steps"], ["frames", "num_frames"], ["seed", "seed"]]) {
      if ($(id).value !== "") body[key] = Number($(id).value);
    }
    let response = await api("/v1/videos", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
    });
    let video = await response.json();
    show(video);
    while (video.status === "queued" || video.status === "in_progress") {
      // The server advises when to ask again (a step while it runs); 400 ms before it knows.
      await sleep(Number(response.headers.get("openai-poll-after-ms")) || 400);
      response = await api("/v1/videos/" + video.id);
      video = await response.json();
      show(video);
    }
    if (video.status !== "completed") throw new Error(video.error ? video.error.message : video.status);
    const blob = await (await api("/v1/videos/" + video.id + "/content")).blob();
    $("player").src = URL.createObjectURL(blob);
    $("status").textContent = video.id + ": completed (" + video.size + ", " + video.seconds + " s)";
  } catch (err) {
    $("status").className = "error";
    $("status").textContent = "error " + err.message;
  } finally {
    $("generate").disabled = false;
  }
});
</script>
</body>
</html>
"""
