"""`python -m engine.train --workspace DIR [--resume] [--max-steps N]`: the training job."""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    import argparse

    from engine.config import ConfigError
    from engine.jobs.context import JobContext, say_error
    from engine.train.data import TrainDataError
    from engine.train.loop import Trainer, TrainError, install_stop_handler
    from engine.workspace import Workspace

    parser = argparse.ArgumentParser(prog="python -m engine.train")
    parser.add_argument("--workspace", required=True)
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    parser.add_argument("--max-steps", type=int, default=None, help="stop (with a checkpoint) after N more steps")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda if available)")
    args = parser.parse_args(argv)
    ctx = None
    try:
        ctx = JobContext.from_env()
    except RuntimeError:
        ctx = None  # run by hand: events go to stdout
    try:
        trainer = Trainer(Workspace(args.workspace), ctx, resume=args.resume, max_steps=args.max_steps,
                          device=args.device)
        if ctx is not None:
            ctx.install_sigterm_handler()
        else:
            install_stop_handler(trainer)
        return trainer.run()
    except (ConfigError, TrainError, TrainDataError) as exc:  # TrainDataError: a damaged record met mid-run
        return say_error(ctx, "training", str(exc))
