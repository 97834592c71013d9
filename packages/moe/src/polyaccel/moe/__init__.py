"""polyaccel MoE: drop-in faster fine-tuning of Hugging Face Mixture-of-Experts models."""
