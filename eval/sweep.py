"""`python -m eval.sweep`: one evaluation runner for tasks x methods x settings, configured by Hydra.

    python -m eval.sweep                                           # conf/eval/sweep.yaml defaults
    python -m eval.sweep task=file task.tasks.0.path=mt_bench.jsonl
    python -m eval.sweep -m tree.total_tokens=12,24,48 task=sharegpt,humaneval
    python -m eval.sweep methods=[vanilla,lookahead] baseline=vanilla lookahead.window=2

Every registered method's options are keys of the config (`options.config_keys`, stored here as `method_options`,
which conf/eval/sweep.yaml's defaults list names): `--exit-layer N` is exit_layer=N, `--medusa DIR` medusa=DIR,
`--lookahead-window W` lookahead.window=W, each null by default (the method's own default); a method added to the
registry has its keys with no yaml edit.

Each run writes records.jsonl (one row per question turn and method), summary.md / summary.json
(per category and overall: tokens/s, speedup vs the baseline, mean accepted length, identical-output
rate), speedup.png and accept_lengths.png into its own folder, and prints the table.
"""
from __future__ import annotations

import sys
from pathlib import Path

from hydra.core.config_store import ConfigStore

from eagle_lite.cli import hydra_entry
from eagle_lite.options import config_keys, option_values, quiet_libraries, target_of

from .evaluation import EvalSettings, Stopped, check_out_dir, evaluate, write_outputs


def store_method_options() -> None:
    """Store every registered method's options as the config `method_options` (`options.config_keys`) that
    conf/eval/sweep.yaml takes: done on import, and again by whoever registers a method later."""
    ConfigStore.instance().store(name="method_options", node=config_keys())


store_method_options()


def _number(c: dict, key: str, kind: type, default=None):
    """Setting `key` as an int or float, or a ValueError naming the setting and the value."""
    value = c.get(key, default)
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise ValueError(f"{key}={value!r} is not a {'whole number' if kind is int else 'number'}") from None


def _shaped(value, key: str, kind: type, example: str):
    """Setting `key` when it is a `kind` (a list, a mapping), or a ValueError naming the setting and the value."""
    if not isinstance(value, kind):
        raise ValueError(f"{key}={value!r} is not a {'list' if kind is list else 'mapping'}, e.g. {key}={example}")
    return value


def settings_from(cfg) -> EvalSettings:
    from omegaconf import OmegaConf

    c = OmegaConf.to_container(cfg, resolve=True)
    threads = c.get("threads")
    methods = _shaped(c["methods"], "methods", list, "[vanilla,eagle]")
    tree = _shaped(c["tree"], "tree", dict, "{depth: 3}")
    tasks = _shaped(c["task"]["tasks"], "task.tasks", list, "[{name: sharegpt}]")
    if not all(isinstance(task, dict) for task in tasks):
        raise ValueError(f"task.tasks={tasks!r} is not a list of mappings, e.g. task.tasks=[{{name: sharegpt}}]")
    for group, keys in config_keys().items():   # a method's nested keys, e.g. lookahead.window
        if isinstance(keys, dict):
            _shaped(c.get(group) or {}, group, dict, f"{{{next(iter(keys))}: ...}}")
    return EvalSettings(target=target_of(c["target"], c.get("draft")), dtype=c["dtype"], methods=methods,
                        baseline=c["baseline"], max_new_tokens=_number(c, "max_new_tokens", int),
                        warmup=bool(c["warmup"]), repeats=_number(c, "repeats", int, 1), tree=tree, tasks=tasks,
                        per_category_limit=c["task"].get("per_category_limit"),
                        threads=None if threads is None else _number(c, "threads", int),
                        options=option_values(c),
                        device=c.get("device", "cpu"), temperature=_number(c, "temperature", float, 0.0),
                        top_p=_number(c, "top_p", float, 1.0), top_k=_number(c, "top_k", int, 0),
                        seed=_number(c, "seed", int, 0), attention=c.get("attention", "auto"),
                        static=c.get("static"), static_max_len=c.get("static_max_len", 2048))


def _main() -> int:
    import hydra
    from hydra.core.hydra_config import HydraConfig

    # an absolute folder: the config is found however the module was started (python -m, or called in-process)
    @hydra.main(config_path=str(Path(__file__).resolve().parents[1] / "conf" / "eval"), config_name="sweep",
                version_base=None)
    def main(cfg) -> None:
        quiet_libraries(False)
        settings = settings_from(cfg)
        out_dir = check_out_dir(Path(HydraConfig.get().runtime.output_dir))
        try:
            records, rows, header = evaluate(settings)
        except Stopped as stop:   # Ctrl-C: the runs that finished are written and shown, then the sweep stops
            print(write_outputs(out_dir, stop.records, stop.rows, settings.baseline, stop.header))
            print(f"(the finished runs' records, summary and plots in {out_dir})")
            raise stop.interrupt from None
        print(write_outputs(out_dir, records, rows, settings.baseline, header))
        print(f"(records, summary and plots in {out_dir})")

    return hydra_entry(main)


if __name__ == "__main__":
    sys.exit(_main())
