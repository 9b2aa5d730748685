"""Integrations of omnibal's balanced packs with other training stacks.

``omnibal.integrations.hf``: Hugging Face ``Trainer`` / accelerate (needs ``pip install omnibal[hf]``).
Submodules are imported explicitly, so ``import omnibal`` never pulls in transformers.
"""
