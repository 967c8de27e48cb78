"""The hook machinery: the interface, schedules, dispatch, registry and checks that the engine uses.

The engine (``core/``, ``settings/``) imports these and never a hook itself: a hook tells the engine
what it needs through ``BaseHook`` (the directories it writes, the signals it catches, where its
checkpoints are, whether it is added by default). The hooks themselves are the library beside it,
``trainloop.hooks``, which users import from (it exports this machinery's public names too).
"""
