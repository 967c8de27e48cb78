"""The digits run, declared for cfgx. specbuild builds every mapping that has a "type".

The ``trainer`` entry is the trainer: ``type`` names the class (registered with specbuild in
train.py), every other key is one of its settings, validated by TrainerSettings. Its ``data``,
``model``, ``optimizer`` and ``lr_scheduler`` are specbuild specs: a registered name or a dotted
import path, ``"*"`` for positional arguments, and ``partial:`` for a factory the trainer calls
with what it has built (the parameters, the optimizer). ``hooks`` keep trainloop's declaration.
``final`` reads the composed config, overrides included: change ``hidden_dim`` or
``trainer.max_steps`` and every place that depends on it follows.
"""

from cfgx import final

config = {
    "hidden_dim": 128,
    "trainer": {
        "type": "DigitsTrainer",
        "max_steps": 400,
        "grad_clip": 5.0,
        "seed": 0,
        "workspace": "runs/config_builder",
        "data": {"type": "DigitsData", "batch_size": 64, "val_fraction": 0.2, "split_seed": 0},
        "model": {
            "type": "torch.nn.Sequential",
            "*": [
                {"type": "torch.nn.Linear", "in_features": 64, "out_features": final.hidden_dim},
                {"type": "torch.nn.ReLU"},
                {"type": "torch.nn.Linear", "in_features": final.hidden_dim, "out_features": 10},
            ],
        },
        "optimizer": {"type": "partial:torch.optim.AdamW", "lr": 0.01, "weight_decay": 1e-4},
        "lr_scheduler": {
            "type": "partial:torch.optim.lr_scheduler.CosineAnnealingLR",
            "T_max": final.trainer.max_steps,
        },
        "hooks": [
            {"type": "progress", "interval": 50},
            {"type": "validation", "evaluate": "val_metrics", "interval": 100},
            {"type": "checkpointing", "interval": 200, "keep_previous": 1, "exit_signals": ["SIGTERM", "SIGINT"]},
        ],
    },
}
