"""toolkit.cost's outputs: the ranked table, its JSON and the time-vs-cost PNG with the Pareto
front marked."""
from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence

from toolkit.planning.cost import economics


def _duration(hours: float) -> str:
  if hours >= 48:
    return f"{hours / 24:.1f} d"
  if hours >= 1:
    return f"{hours:.1f} h"
  return f"{hours * 60:.0f} min"


def _money(dollars: float) -> str:
  if dollars >= 1e6:
    return f"${dollars / 1e6:.2f}M"
  if dollars >= 1e3:
    return f"${dollars / 1e3:.3g}k"
  return f"${dollars:.2f}"


def format_table(ranked: Sequence[economics.Option], layouts: dict, front: set,
                 deadline_chips: dict) -> str:
  """One row per target and mode, in the ranking's order; `*` marks the Pareto front."""
  rows = [("#", "target", "mode", "chips", "layout", "step", "tokens/s", "MFU", "goodput",
           "time", "cost", "$/M tok") + (("chips by deadline",) if deadline_chips else ())]
  for i, o in enumerate(ranked, 1):
    layout = layouts[o.target]
    c, step = layout.candidate, layout.step
    mesh = "x".join(f"{k}{v}" for k, v in step["mesh"].items() if v > 1) or "1"
    label = (f"{c.overrides['sharding.preset']} {mesh} remat={c.overrides['model.remat']} "
             f"micro={c.overrides['train.microbatches']}")
    needed = deadline_chips.get((o.target, o.mode), "")
    rows.append((f"{i}{'*' if (o.target, o.mode) in front else ''}", o.target, o.mode,
                 str(o.chips), label, f"{step['total_s']:.3g} s", f"{o.tokens_per_second:,.0f}",
                 f"{step['mfu']:.0%}", f"{o.goodput:.1%}", _duration(o.hours), _money(o.dollars),
                 f"${o.dollars_per_million_tokens:.3f}")
                + ((str(needed) if needed else "none",) if deadline_chips else ()))
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
  return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip()
                   for r in rows)


def model_shape(config) -> str:
  """The shape of `config`'s model in a few words, with its parameter count: what a custom
  shape (--config.model.FIELD overrides) is ranked for."""
  from toolkit.training import config as config_lib  # pylint: disable=g-import-not-at-top
  model = config_lib.model_config(config.model)
  experts = f", {model.n_experts} experts" if getattr(model, "n_experts", 0) else ""
  return (f"{model.num_params() / 1e9:.2f} B parameters: d_model {model.d_model}, "
          f"{model.n_layers} layers, {model.n_heads} heads, MLP {model.mlp_dim}{experts}, "
          f"vocab {model.vocab_size}, sequence {config.data.seq_len}")


def _label_offsets(options: Sequence[economics.Option]) -> list[tuple[int, int]]:
  """Each point's label offset in points: below the earlier labels of points close to it (in
  log-log space), so no two labels print over each other."""
  placed, offsets = [], []
  for o in options:
    near = sum(abs(math.log10(o.hours / p.hours)) < 0.08
               and abs(math.log10(o.dollars / p.dollars)) < 0.08 for p in placed)
    offsets.append((4, 3 - 9 * near))
    placed.append(o)
  return offsets


def plot(options: Sequence[economics.Option], front: Sequence[economics.Option], path: str,
         title: str, deadline_h: float | None = None) -> str:
  """Time to the budget against its cost, one point per target and mode, the front joined,
  and the deadline (when given) as a vertical line."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt, ticker  # pylint: disable=g-import-not-at-top
  from toolkit.training import metrics as metrics_lib  # pylint: disable=g-import-not-at-top
  fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=120)
  modes = sorted({o.mode for o in options})
  markers = dict(zip(modes, "osD^"))
  for o, offset in zip(options, _label_offsets(options)):
    ax.scatter(o.hours / 24, o.dollars, marker=markers[o.mode], s=36,
               color="tab:red" if o in front else "tab:gray")
    ax.annotate(f"{o.target} {o.mode}", (o.hours / 24, o.dollars), fontsize=7,
                xytext=offset, textcoords="offset points")
  if deadline_h:
    ax.axvline(deadline_h / 24, color="tab:blue", ls="--", lw=1,
               label=f"deadline: {deadline_h / 24:g} days")
  ax.plot([o.hours / 24 for o in front], [o.dollars for o in front], "-", color="tab:red",
          lw=1, label="Pareto front: no option is both faster and cheaper")
  for mode in modes:
    ax.scatter([], [], marker=markers[mode], color="tab:gray", label=f"pricing: {mode}")
  ax.set_xlabel("days to the token budget")
  ax.set_ylabel("dollars to the token budget")
  ax.set_xscale("log")
  ax.set_yscale("log")
  ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
  ax.xaxis.set_minor_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
  ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: _money(v)))
  ax.yaxis.set_minor_formatter(ticker.FuncFormatter(lambda v, _: _money(v)))
  ax.tick_params(which="minor", labelsize=7)
  ax.set_title("\n".join(textwrap.wrap(title, 90)), fontsize=9)
  ax.grid(alpha=0.3, which="both")
  ax.legend(fontsize=7)
  fig.tight_layout()
  metrics_lib.save_figure(fig, path)
  plt.close(fig)
  return path
