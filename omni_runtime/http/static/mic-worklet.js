// The playground microphone's AudioWorklet: the capture context runs at 24 kHz (the
// browser resamples the microphone to it), so this only cuts the input into 40 ms
// pieces of float samples for the page, which sends them as PCM16.
"use strict";

const PIECE = 960; // 40 ms at 24 kHz: one `input_audio_buffer.append` each

class PcmTap extends AudioWorkletProcessor {
  constructor() {
    super();
    this.piece = new Float32Array(PIECE);
    this.filled = 0;
  }

  process(inputs) {
    const channel = inputs[0] && inputs[0][0];
    if (!channel) return true;
    for (let i = 0; i < channel.length; i++) {
      this.piece[this.filled++] = channel[i];
      if (this.filled === PIECE) {
        this.port.postMessage(this.piece, [this.piece.buffer]);
        this.piece = new Float32Array(PIECE);
        this.filled = 0;
      }
    }
    return true;
  }
}

registerProcessor("pcm-tap", PcmTap);
