// The speech page: speaks through POST /v1/audio/speech (raw PCM, streamed) and plays each chunk as it
// arrives with WebAudio, as a zero-buffer player would, counting the times it runs dry (underruns).
// Same-origin requests only: nothing is fetched from anywhere else.
"use strict";

const RATE = 24000; // the model's sample rate; `pcm` is s16le mono at this rate
const FRAME_S = 0.08; // one model frame
// Playback starts this long after the first audio byte (the start-up buffer field, 0 = a zero-buffer player), plus
// WebAudio's own margin: its clock moves a render quantum (128 samples) at a time and audio started "now" lands
// at the next quantum. A browser's audio thread renders in bursts of 10-20 ms and shares the CPU with the page,
// so a zero-buffer player stalls for a quantum now and then even when every chunk is on time.
const LEAD_S = 256 / RATE;
const $ = (id) => document.getElementById(id);
// What the page did, for people and for tests (tests/test_page.py reads it).
const state = { phase: "loading", ttfaMs: null, serverTtfaMs: null, audioS: 0, underruns: 0, stallMs: 0, stalls: [], arrivals: [], playedS: 0, error: null };
window.qttsPage = state;
let info = null;
let ctx = null;
let current = null; // AbortController of the request in flight
let recorder = null;
let recorded = null; // Blob from the microphone
// The API key, for a server that checks keys: asked for when the server answers 401, kept in sessionStorage (this
// tab only, gone when it closes), sent as Authorization: Bearer on every request.
const KEY_ITEM = "qtts-api-key";

class KeyRefused extends Error {}

function headers(extra = {}) {
  const key = sessionStorage.getItem(KEY_ITEM);
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

// fetch with the key; a 401 asks for one (again) and throws
async function call(url, options = {}) {
  const r = await fetch(url, { ...options, headers: headers(options.headers) });
  if (r.status === 401) {
    askForKey(sessionStorage.getItem(KEY_ITEM) ? "the server refused this key" : "this server needs an API key");
    throw new KeyRefused(await errorText(r));
  }
  return r;
}

function askForKey(why) {
  sessionStorage.removeItem(KEY_ITEM);
  $("key").hidden = false;
  setPhase("key", why);
}

async function errorText(response) {
  try {
    const e = (await response.json()).error || {};
    return `${response.status}: ${e.message || response.statusText}${e.param ? ` (field: ${e.param})` : ""}`;
  } catch (_) {
    return `${response.status} ${response.statusText}`;
  }
}

async function getJSON(url) {
  const r = await call(url);
  if (!r.ok) throw new Error(await errorText(r));
  return r.json();
}

function showError(message) {
  state.error = message || null;
  $("error").textContent = message;
  $("error").hidden = !message;
}

function setPhase(phase, text) {
  state.phase = phase;
  $("status").textContent = text || phase;
}

function option(select, value, label) {
  const o = document.createElement("option");
  o.value = value;
  o.textContent = label || value;
  select.appendChild(o);
  return o;
}

async function loadVoices(select) {
  const v = await getJSON("/v1/audio/voices");
  const voice = $("voice");
  voice.replaceChildren();
  const own = document.createElement("optgroup");
  own.label = info.kind === "base" ? "registered voices" : "speakers";
  for (const item of v.voices) option(own, item.id);
  const openai = document.createElement("optgroup");
  openai.label = "OpenAI names";
  for (const a of v.aliases) if (a.available) option(openai, a.id, `${a.id} → ${a.voice}`);
  for (const group of [openai, own]) if (group.children.length) voice.appendChild(group);
  if (!voice.options.length) option(voice, "", info.kind === "base" ? "(register a voice below)" : "(none: the instruction describes it)");
  const wanted = [select, "alloy"].find((x) => x && [...voice.options].some((o) => o.value === x));
  if (wanted) voice.value = wanted;
}

async function load() {
  try {
    info = (await getJSON("/v1/models")).data[0].info;
    $("model").textContent = `${info.model} (${info.kind}${info.noise ? "; random weights: the audio is noise" : ""})`;
    for (const lang of info.languages || []) if (lang !== "auto") option($("language"), lang);
    $("instruct").disabled = !info.accepts_instruct;
    // random weights rarely end on their own: cap them, as `qtts-jax synth` does
    if (info.noise) $("max-seconds").value = (24 * FRAME_S).toFixed(2);
    $("register").hidden = info.kind !== "base";
    await loadVoices();
    setPhase("idle");
  } catch (e) {
    if (e instanceof KeyRefused) return;
    showError(`could not read the server's model and voices: ${e.message}`);
    setPhase("error");
  }
}

function useKey() {
  sessionStorage.setItem(KEY_ITEM, $("api-key").value.trim());
  $("api-key").value = "";
  $("key").hidden = true;
  showError("");
  load();
}

function wav(chunks, samples) {
  const out = new DataView(new ArrayBuffer(44 + 2 * samples));
  const text = (at, s) => [...s].forEach((c, i) => out.setUint8(at + i, c.charCodeAt(0)));
  text(0, "RIFF"); out.setUint32(4, 36 + 2 * samples, true); text(8, "WAVEfmt ");
  out.setUint32(16, 16, true); out.setUint16(20, 1, true); out.setUint16(22, 1, true);
  out.setUint32(24, RATE, true); out.setUint32(28, 2 * RATE, true); out.setUint16(32, 2, true);
  out.setUint16(34, 16, true); text(36, "data"); out.setUint32(40, 2 * samples, true);
  let at = 44;
  for (const c of chunks) for (let i = 0; i < c.length; i++, at += 2) out.setInt16(at, c[i], true);
  return new Blob([out.buffer], { type: "audio/wav" });
}

function audioContext() {
  if (!ctx) {
    try {
      ctx = new AudioContext({ sampleRate: RATE });
    } catch (_) {
      ctx = new AudioContext(); // buffers at 24 kHz are resampled
    }
  }
  return ctx;
}

function showStats() {
  $("ttfa").textContent = state.ttfaMs === null ? "–" : state.ttfaMs.toFixed(0);
  $("server-ttfa").textContent = state.serverTtfaMs === null ? "" : `(server: ${state.serverTtfaMs} ms)`;
  $("audio-s").textContent = state.audioS.toFixed(2);
  $("underruns").textContent = String(state.underruns);
  $("stall").textContent = state.underruns ? `(${state.stallMs.toFixed(0)} ms stalled)` : "";
}

async function speak() {
  if (current) current.abort();
  showError("");
  Object.assign(state, { ttfaMs: null, serverTtfaMs: null, audioS: 0, underruns: 0, stallMs: 0, stalls: [], arrivals: [], playedS: 0 });
  showStats();
  $("download").hidden = true;
  const body = { input: $("text").value, language: $("language").value, response_format: "pcm", stream: true };
  if ($("voice").value) body.voice = $("voice").value;
  if ($("instruct").value && !$("instruct").disabled) body.instructions = $("instruct").value;
  const seconds = parseFloat($("max-seconds").value);
  if (seconds > 0) body.max_frames = Math.max(1, Math.round(seconds / FRAME_S));
  const audio = audioContext();
  await audio.resume();
  const abort = new AbortController();
  current = abort;
  $("stop").disabled = false;
  setPhase("speaking", "waiting for the first audio…");
  const t0 = performance.now();
  const chunks = [];
  let carry = new Uint8Array(0); // an odd byte left over between network chunks
  let next = 0; // AudioContext time at which the next sample plays
  let start = 0;
  try {
    const r = await call("/v1/audio/speech", { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body), signal: abort.signal });
    if (!r.ok) {
      showError(await errorText(r));
      setPhase("error");
      return;
    }
    state.serverTtfaMs = r.headers.get("X-TTFA-Ms");
    const reader = r.body.getReader();
    for (;;) {
      const { done, value } = await reader.read();
      if (done) break;
      const bytes = new Uint8Array(carry.length + value.length);
      bytes.set(carry);
      bytes.set(value, carry.length);
      const n = bytes.length >> 1;
      carry = bytes.slice(2 * n);
      if (!n) continue;
      const pcm = new Int16Array(bytes.slice(0, 2 * n).buffer);
      chunks.push(pcm);
      const buffer = audio.createBuffer(1, n, RATE);
      const samples = buffer.getChannelData(0);
      for (let i = 0; i < n; i++) samples[i] = pcm[i] / 32768;
      const source = audio.createBufferSource();
      source.buffer = buffer;
      source.connect(audio.destination);
      const now = audio.currentTime;
      if (state.ttfaMs === null) {
        state.ttfaMs = performance.now() - t0;
        next = start = now + LEAD_S + Math.max(0, parseFloat($("buffer-ms").value) || 0) / 1000;
        setPhase("speaking", "playing as it streams…");
      } else if (now - next > 1e-6) { // the audio in hand ran out before this chunk came: the player stalled
        // (both times are whole render quanta, so a real stall is one or more; 1e-6 s is float rounding)
        state.underruns += 1;
        state.stallMs += 1000 * (now - next);
        state.stalls.push({ atS: next - start, ms: 1000 * (now - next) });
        next = now;
      }
      source.start(next);
      state.arrivals.push(Math.round(performance.now() - t0));
      next += n / RATE;
      state.audioS += n / RATE;
      showStats();
    }
  } catch (e) {
    if (e.name === "AbortError") {
      setPhase("stopped");
      return;
    }
    if (e instanceof KeyRefused) return;
    showError(`the stream broke off: ${e.message}`);
    setPhase("error");
    return;
  } finally {
    if (current === abort) current = null;
    $("stop").disabled = true;
    if (chunks.length) {
      const link = $("download");
      if (link.href) URL.revokeObjectURL(link.href);
      link.href = URL.createObjectURL(wav(chunks, chunks.reduce((a, c) => a + c.length, 0)));
      link.hidden = false;
    }
  }
  setPhase("playing", `received ${state.audioS.toFixed(2)} s of audio; playing…`);
  const left = Math.max(0, next - audio.currentTime);
  setTimeout(() => {
    state.playedS = audio.currentTime - start;
    if (state.phase === "playing") setPhase("done", `done: ${state.audioS.toFixed(2)} s of audio, ${state.underruns} underruns`);
  }, 1000 * left + 50);
}

async function toggleRecording() {
  if (recorder) {
    recorder.stop();
    return;
  }
  try {
    const stream = await navigator.mediaDevices.getUserMedia({ audio: true });
    const parts = [];
    recorder = new MediaRecorder(stream);
    recorder.ondataavailable = (e) => parts.push(e.data);
    recorder.onstop = () => {
      stream.getTracks().forEach((t) => t.stop());
      recorded = new Blob(parts, { type: recorder.mimeType });
      recorder = null;
      $("record").textContent = "Record again";
      $("rec-status").textContent = `recorded ${(recorded.size / 1024).toFixed(0)} KiB`;
    };
    recorder.start();
    $("record").textContent = "Stop recording";
    $("rec-status").textContent = "recording… (1-30 s)";
  } catch (e) {
    $("rec-status").textContent = `no microphone: ${e.message}`;
  }
}

async function register() {
  const form = new FormData();
  const name = $("reg-name").value.trim();
  form.append("name", name);
  const file = $("reg-file").files[0];
  if (file) form.append("audio", file, file.name);
  else if (recorded) form.append("audio", recorded, "microphone.webm");
  if ($("reg-transcript").value) form.append("transcript", $("reg-transcript").value);
  $("reg-result").textContent = "registering…";
  let r;
  try {
    r = await call("/v1/audio/voices", { method: "POST", body: form });
  } catch (e) {
    $("reg-result").textContent = "";
    if (!(e instanceof KeyRefused)) throw e;
    return;
  }
  if (!r.ok) {
    $("reg-result").textContent = "";
    showError(await errorText(r));
    return;
  }
  const v = await r.json();
  showError("");
  $("reg-result").textContent = `registered ${v.id} (${v.mode}, ${Number(v.seconds).toFixed(1)} s)`;
  await loadVoices(v.id);
}

$("speak").addEventListener("click", speak);
$("stop").addEventListener("click", () => current && current.abort());
$("record").addEventListener("click", toggleRecording);
$("reg-submit").addEventListener("click", register);
$("key-submit").addEventListener("click", useKey);
$("api-key").addEventListener("keydown", (e) => e.key === "Enter" && useKey());
load();
