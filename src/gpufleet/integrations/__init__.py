"""Bridges between gpufleet and the frameworks users train with: Hugging Face Trainer and
Lightning callbacks, Optuna studies. Each module imports its framework, which stays an
optional dependency: importing ``gpufleet`` never imports them."""
