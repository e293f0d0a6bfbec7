"""EAGLE-3 drafter training: model, draft vocabulary, data, training loop, SGLang export.

Entry point for the detached job: `python -m engine.train --workspace DIR [--resume]`
(see engine.train.launch.build_train_argv for the torchrun form on several GPUs).
"""
