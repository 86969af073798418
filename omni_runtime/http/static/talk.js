// The playground's microphone panel: a conversation over /v1/realtime (the OpenAI Realtime
// API). The microphone is captured in an AudioContext at 24 kHz, so the browser resamples
// it to the protocol's rate; an AudioWorklet (mic-worklet.js) hands 40 ms pieces to the
// page, which sends them as base64 PCM16 `input_audio_buffer.append` events.
//   hold to talk: append while the button is held; on release, commit + response.create.
//   talk freely:  append all the time; the server's VAD commits each turn and answers it.
// The answer's audio is scheduled back to back on the same context as it streams. Speaking
// over it interrupts: pressing the button (or the server hearing speech start) stops the
// playback, a response still running is cancelled (by the server with VAD, by
// `response.cancel` when holding), and the answer is truncated where its playback stopped
// (`conversation.item.truncate`), so the conversation holds no words the user did not hear.
"use strict";

const TALK_RATE = 24000;
const MIN_HOLD_MS = 100; // the server refuses a shorter commit

function initTalk(config) {
  const $ = (id) => document.getElementById(id);
  const panel = $("talk-panel"), button = $("talk"), free = $("freetalk");
  let ws = null, opening = null, ctx = null, mic = null;
  let holding = false, pressed = false, heldMs = 0, sentMs = 0;
  let turnEnd = null, playAt = 0, sources = [], active = null, firstAudio = true;
  let turns = 0, bargeIns = 0, rows = new Map(), current = null, heardRow = null;
  // current: the turn being answered; heardRow: the one whose audio plays (it may be done)

  const set = (key, value) => { panel.dataset[key] = String(value); };
  const say = (msg, isError) => {
    $("talk-status").textContent = msg;
    $("talk-status").className = isError ? "error" : "";
  };
  const ms = (t) => (t < 1000 ? `${t.toFixed(0)} ms` : `${(t / 1000).toFixed(2)} s`);

  if (!config.talk_model) {
    button.disabled = free.disabled = true;
    say("no pipeline served takes speech: serve one (e.g. workers/listen.yaml) to talk");
    return;
  }
  if (!navigator.mediaDevices || !navigator.mediaDevices.getUserMedia) {
    button.disabled = free.disabled = true;
    say("the microphone needs https or localhost", true);
    return;
  }
  say(`talk to ${config.talk_model}`);

  // --- the socket ------------------------------------------------------------------------

  function send(ev) { if (ws && ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify(ev)); }

  function turnDetection() {
    send({ type: "session.update", session: { type: "realtime", audio: { input: {
      turn_detection: free.checked ? { type: "server_vad" } : null } } } });
  }

  function connect() {
    if (ws && ws.readyState === WebSocket.OPEN) return Promise.resolve();
    if (opening) return opening;
    const url = new URL(`v1/realtime?model=${encodeURIComponent(config.talk_model)}`, location.href);
    url.protocol = location.protocol === "https:" ? "wss:" : "ws:";
    const key = $("key").value;
    const protocols = key ? ["realtime", `openai-insecure-api-key.${key}`] : ["realtime"];
    say("connecting…");
    opening = new Promise((resolve, reject) => {
      const sock = new WebSocket(url, protocols);
      sock.onopen = () => { ws = sock; opening = null; turnDetection(); resolve(); };
      sock.onmessage = (m) => handle(JSON.parse(m.data));
      sock.onclose = (e) => {
        if (opening) { opening = null; reject(new Error(`cannot open ${url.pathname} (${e.code})`)); }
        if (ws === sock) { ws = null; active = null; say(`session closed (${e.code})`, e.code !== 1000); }
      };
    });
    return opening;
  }

  // --- the microphone ----------------------------------------------------------------------

  async function openMic() {
    ctx = ctx || new AudioContext({ sampleRate: TALK_RATE });
    await ctx.resume();
    if (mic) return;
    let tap;  // made before the microphone opens, which would lose the first words to it
    if (ctx.audioWorklet) {
      await ctx.audioWorklet.addModule("playground/mic-worklet.js");
      tap = new AudioWorkletNode(ctx, "pcm-tap");
      tap.port.onmessage = (e) => heard(e.data);
    } else {  // no AudioWorklet: the deprecated ScriptProcessor does the same
      tap = ctx.createScriptProcessor(1024, 1, 1);
      tap.onaudioprocess = (e) => heard(new Float32Array(e.inputBuffer.getChannelData(0)));
    }
    const stream = await navigator.mediaDevices.getUserMedia({
      audio: { channelCount: 1, echoCancellation: true, noiseSuppression: true, autoGainControl: true },
    });  // echo cancellation: the answer from the speakers must not interrupt itself
    const source = ctx.createMediaStreamSource(stream);
    source.connect(tap);
    tap.connect(ctx.destination);  // pulled by the graph; it writes silence
    mic = { stream, source, tap };
  }

  function heard(samples) {
    let sum = 0;
    for (const s of samples) sum += s * s;
    $("mic-level").value = Math.min(1, 4 * Math.sqrt(sum / samples.length));
    if (!(holding || free.checked) || !ws) return;
    send({ type: "input_audio_buffer.append", audio: pcm16Base64(samples) });
    const piece = (1000 * samples.length) / TALK_RATE;
    sentMs += piece;
    if (holding) heldMs += piece;
    set("sentMs", Math.round(sentMs));
  }

  function pcm16Base64(samples) {
    const bytes = new Uint8Array(samples.length * 2), view = new DataView(bytes.buffer);
    for (let i = 0; i < samples.length; i++) {
      view.setInt16(2 * i, Math.round(Math.max(-1, Math.min(1, samples[i])) * 32767), true);
    }
    let bin = "";
    for (let i = 0; i < bytes.length; i += 0x8000) {
      bin += String.fromCharCode.apply(null, bytes.subarray(i, i + 0x8000));
    }
    return btoa(bin);
  }

  // --- the answer's audio ------------------------------------------------------------------

  let lastStart = 0;  // the context time the latest piece starts

  function play(b64) {
    const bin = atob(b64), n = bin.length >> 1, samples = new Float32Array(n);
    for (let i = 0; i < n; i++) {
      const v = bin.charCodeAt(2 * i) | (bin.charCodeAt(2 * i + 1) << 8);
      samples[i] = (v >= 0x8000 ? v - 0x10000 : v) / 32768;
    }
    if (!ctx || n === 0) return n;
    const buf = ctx.createBuffer(1, n, TALK_RATE);
    buf.copyToChannel(samples, 0);
    const src = ctx.createBufferSource();
    src.buffer = buf;
    src.connect(ctx.destination);
    playAt = Math.max(playAt, ctx.currentTime + 0.05);
    lastStart = playAt;
    src.start(playAt);
    playAt += buf.duration;
    sources.push(src);
    src.onended = () => { sources = sources.filter((s) => s !== src); };
    return n;
  }

  const playing = () => ctx !== null && playAt > ctx.currentTime;

  function stopPlayback() {
    for (const src of sources) { try { src.stop(); } catch (e) { /* not started */ } }
    sources = [];
    playAt = 0;
  }

  function interrupt(cancel) {
    // Speech over the answer: silence it now; a response still running is cancelled.
    const wasPlaying = playing();
    if (!wasPlaying && !active) return;
    if (wasPlaying && heardRow) {
      heardRow.row.classList.add("interrupted");
      if (heardRow.itemId && heardRow.startsAt !== null) {  // what of it was heard
        const heardMs = Math.min(heardRow.audioMs, 1000 * (ctx.currentTime - heardRow.startsAt));
        send({ type: "conversation.item.truncate", item_id: heardRow.itemId,
               content_index: heardRow.audioPart, audio_end_ms: Math.max(0, Math.floor(heardMs)) });
      }
    }
    stopPlayback();  // a running response is marked when its cancelled response.done comes
    if (cancel && active) send({ type: "response.cancel" });
    bargeIns++;
    set("bargeIns", bargeIns);
    $("talk-barge-ins").textContent = String(bargeIns);
  }

  // --- hold to talk ------------------------------------------------------------------------

  async function press() {
    if (free.checked || pressed) return;
    pressed = true;
    interrupt(true);
    try {
      await connect();
      await openMic();
    } catch (e) {
      pressed = false;
      say(`microphone: ${e.message}`, true);
      return;
    }
    if (!pressed) return;  // released while the microphone was opening
    send({ type: "input_audio_buffer.clear" });
    holding = true; heldMs = 0;
    button.textContent = "Release to send";
    set("state", "holding");
    say("listening…");
  }

  function release() {
    if (!pressed) return;
    pressed = false;
    if (!holding) return;
    holding = false;
    button.textContent = "Hold to talk";
    if (heldMs < MIN_HOLD_MS) {
      send({ type: "input_audio_buffer.clear" });
      say("hold the button while you speak");
      set("state", "ready");
      return;
    }
    turnEnd = performance.now();
    send({ type: "input_audio_buffer.commit" });
    send({ type: "response.create" });
    set("state", "thinking");
    say("thinking…");
  }

  async function freeTalk() {
    button.disabled = free.checked;
    try {
      await connect();
      await openMic();
    } catch (e) {
      free.checked = false; button.disabled = false;
      say(`microphone: ${e.message}`, true);
      return;
    }
    turnDetection();
    if (!free.checked) send({ type: "input_audio_buffer.clear" });
    set("state", free.checked ? "listening" : "ready");
    say(free.checked ? "talk freely: listening…" : `talk to ${config.talk_model}`);
  }

  // --- server events -----------------------------------------------------------------------

  function row(itemId) {
    const el = document.createElement("div");
    el.className = "turn";
    el.innerHTML = '<div class="you"><b>You</b> <span class="said">…</span></div>'
      + '<div class="model"><b>Model</b> <span class="said"></span> <span class="badge"></span></div>';
    $("dialogue").appendChild(el);
    const r = { row: el, you: el.querySelector(".you .said"), model: el.querySelector(".model .said"),
                badge: el.querySelector(".badge"), audioMs: 0,
                itemId: null, audioPart: 0, startsAt: null };  // the answer's audio
    if (itemId) rows.set(itemId, r);
    return r;
  }

  const events = window.talkEvents = [];  // the last server events, for the console

  function handle(ev) {
    const why = ev.error ? ` ${ev.error.code}: ${ev.error.message}` : "";
    events.push(`${(performance.now() / 1000).toFixed(3)} ${ev.type}${ev.response ? " " + ev.response.status : ""}${why}`);
    if (events.length > 200) events.shift();
    switch (ev.type) {
      case "input_audio_buffer.speech_started":
        interrupt(false);  // the server cancels a running response itself
        set("state", "hearing");
        say("hearing you…");
        break;
      case "input_audio_buffer.speech_stopped":
        turnEnd = performance.now();
        set("state", "thinking");
        say("thinking…");
        break;
      case "input_audio_buffer.committed":
        current = row(ev.item_id);
        break;
      case "conversation.item.input_audio_transcription.completed": {
        const r = rows.get(ev.item_id);
        if (r) r.you.textContent = ev.transcript || "(nothing heard)";
        break;
      }
      case "response.created":
        active = ev.response.id; firstAudio = true;
        if (!current) current = row(null);
        break;
      case "response.output_audio.delta":
        if (firstAudio && current && turnEnd !== null) {
          const t = performance.now() - turnEnd;
          current.badge.textContent = `first audio ${ms(t)}`;
          current.row.dataset.ttfaMs = String(Math.round(t));
          $("talk-ttfa").textContent = ms(t);
        }
        firstAudio = false;
        heardRow = current;
        set("state", "speaking");
        say("answering…");
        if (current) {
          const n = play(ev.delta);
          current.audioMs += (1000 * n) / TALK_RATE;
          current.row.dataset.audioMs = String(Math.round(current.audioMs));
          if (current.startsAt === null && ctx && n > 0) {
            current.itemId = ev.item_id;
            current.audioPart = ev.content_index;
            current.startsAt = lastStart;
          }
        } else play(ev.delta);
        break;
      case "conversation.item.truncated": {
        const r = [...rows.values(), current, heardRow].find((t) => t && t.itemId === ev.item_id);
        if (r) r.row.dataset.truncatedMs = String(ev.audio_end_ms);
        break;
      }
      case "response.output_audio_transcript.delta":
      case "response.output_text.delta":
        if (current) current.model.textContent += ev.delta;
        break;
      case "response.done": {
        const status = ev.response.status;
        if (ev.response.id === active) active = null;
        if (status === "cancelled") { stopPlayback(); if (current) current.row.classList.add("interrupted"); }
        const failed = status === "failed" && ev.response.status_details && ev.response.status_details.error;
        // a response cancelled because the user speaks, or holds the button, is done while
        // they still speak: the panel goes on saying it hears them
        const answering = ["thinking", "speaking"].includes(panel.dataset.state);
        if (failed) say(`error: ${failed.message}`, true);
        else if (answering) say(free.checked ? "talk freely: listening…" : `talk to ${config.talk_model}`);
        if (current) current.row.dataset.status = status;
        current = null; turnEnd = null;
        turns++;
        set("turns", turns);
        if (status === "completed") set("completed", Number(panel.dataset.completed || 0) + 1);
        $("talk-turns").textContent = String(turns);
        if (answering) set("state", free.checked ? "listening" : "ready");
        break;
      }
      case "error":
        say(`error: ${ev.error.message}`, true);
        break;
      default:
        break;
    }
  }

  setInterval(() => set("playing", playing()), 50);

  button.addEventListener("pointerdown", (e) => {
    if (e.button !== 0) return;
    button.setPointerCapture(e.pointerId);
    press();
  });
  button.addEventListener("pointerup", release);
  button.addEventListener("pointercancel", release);
  button.addEventListener("keydown", (e) => {
    if ((e.key === " " || e.key === "Enter") && !e.repeat) { e.preventDefault(); press(); }
  });
  button.addEventListener("keyup", (e) => { if (e.key === " " || e.key === "Enter") release(); });
  window.addEventListener("blur", release);  // a release the page would not see
  free.addEventListener("change", freeTalk);
  set("state", "ready");
}
