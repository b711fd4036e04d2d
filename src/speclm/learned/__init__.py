"""Drafters trained on the target's own hidden states: Medusa heads and an EAGLE-style head.

``modules`` holds the networks, ``checkpoint`` their on-disk format (safetensors plus a JSON
config naming the target they were made for), ``data`` the self-distillation data and ``train``
the training loops behind ``speclm train-drafter``.
"""
