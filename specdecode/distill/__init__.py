"""Draft training: self-distillation corpus, EAGLE-style heads and small draft models."""
