"""The path from an Accelerate YAML file to the model ``prepare`` built, drawn from a
real run: the keys of the file, the variables ``accelerate launch`` gave the ranks
(``launcher_env``), the plugin fields they became, and what the prepared model shows
(``inspect_config``), one row per setting."""

from __future__ import annotations

import matplotlib.pyplot as plt
import yaml

# (YAML key, launcher variable, plugin field)
SETTINGS = [
    ("fsdp_version", "FSDP_VERSION", "fsdp_version"),
    ("fsdp_auto_wrap_policy", "FSDP_AUTO_WRAP_POLICY", "auto_wrap_policy"),
    (
        "fsdp_reshard_after_forward",
        "FSDP_RESHARD_AFTER_FORWARD",
        "reshard_after_forward",
    ),
    ("mixed_precision", "(none)", "mixed_precision_policy"),
    ("fsdp_state_dict_type", "FSDP_STATE_DICT_TYPE", "state_dict_type"),
    (
        "fsdp_cpu_ram_efficient_loading",
        "FSDP_CPU_RAM_EFFICIENT_LOADING",
        "cpu_ram_efficient_loading",
    ),
]


def _short(name: str) -> str:
    return name.replace("._checkpoint_wrapped_module", "/inner")


def _saved(files: dict) -> str:
    shards = [f for f in files if f.endswith(".distcp") and "model" in f]
    return f"{len(shards)} shard files + index" if shards else "one model file"


def path_rows(yaml_text: str, env: dict[str, str], result: dict) -> list[tuple]:
    """One row per setting: (file, variable, plugin field, prepared model), each a
    short string, and whether the setting came from nobody's file."""
    config = yaml.safe_load(yaml_text)
    keys = dict(config.get("fsdp_config", {}))
    if "mixed_precision" in config:
        keys["mixed_precision"] = config["mixed_precision"]
    plugin = result["plugin"]
    resharded = [
        _short(n) for n, yes in result["resharded after forward"].items() if yes
    ]
    model = {
        "fsdp_version": f"fully_shard, mesh {result['mesh']}",
        "auto_wrap_policy": "units: " + ", ".join(_short(u) for u in result["units"]),
        "reshard_after_forward": "sharded again: " + (", ".join(resharded) or "none"),
        "mixed_precision_policy": f"params {result['param dtype']}",
        "state_dict_type": _saved(result["files"]),
        "cpu_ram_efficient_loading": "lm_head tied, trains"
        if result["lm_head tied to wte"] and result["lm_head stepped"]
        else "lm_head untied, frozen",
    }
    fields = dict(
        plugin,
        fsdp_version=2,
        mixed_precision_policy="set" if result["mixed precision policy"] else "None",
    )
    rows = []
    for key, var, field in SETTINGS:
        value = fields.get(field)
        rows.append(
            (
                key.removeprefix("fsdp_"),
                str(keys[key]) if key in keys else "—",
                env.get(var, "—"),
                str(value).removesuffix("_STATE_DICT").lower(),
                model[field],
                key not in keys and var in env,
            )
        )
    return rows


def draw_path(yaml_text: str, env: dict[str, str], result: dict, title: str):
    """Two lines per setting: its name, then its value at each stage joined by arrows;
    a setting nobody wrote in the file but the launcher set is drawn in red. Narrow,
    so that it reads on a phone."""
    rows = path_rows(yaml_text, env, result)
    fig, ax = plt.subplots(figsize=(5.6, 0.95 * len(rows) + 1.3))
    top = 2 * len(rows) + 1
    ax.text(
        0,
        top,
        "YAML → env → plugin → prepared model",
        fontsize=13,
        weight="bold",
        va="center",
    )
    for i, (setting, *values, surprise) in enumerate(rows):
        y = top - 1.2 - 2 * i
        color = "#c0392b" if surprise else "#222222"
        ax.text(0, y, setting, fontsize=14, weight="bold", va="center", color=color)
        ax.text(
            0.3, y - 0.85, " → ".join(values), fontsize=13, va="center", color=color
        )
    ax.set_xlim(0, 10)
    ax.set_ylim(top - 2 * len(rows) - 0.6, top + 0.6)
    ax.axis("off")
    ax.set_title(title, fontsize=14, loc="left")
    fig.tight_layout()
    return fig
