"""polyaccel ASR: high-throughput batch speech-to-text (Whisper, ConformerAED)."""
