"""Hooks: the pieces that plug into a trainer's loop (one module per hook)."""

from .base import HOOK_EVENTS, BaseHook, hook_dispatch

__all__ = ["HOOK_EVENTS", "BaseHook", "hook_dispatch"]
