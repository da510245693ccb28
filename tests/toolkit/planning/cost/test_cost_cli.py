"""`python -m toolkit.cost` as a user runs it: a ranking with a price file of their own (spot
included), its JSON and PNG, and the mistakes that must each be one `error:` line."""
from __future__ import annotations

import json
import os
import pathlib

import pytest

from tests import preloaded
from tests.toolkit.test_cli import the_error_line
from toolkit.planning.cost import economics

TIMEOUT_S = 180  # ~5 s here
CONFIG = "--config=experiments/lm.py:size=1b"


def cost(*args: str) -> "preloaded.subprocess.CompletedProcess":
  return preloaded.run("toolkit.cost", args, env=dict(os.environ), timeout=TIMEOUT_S)


def _prices(path: pathlib.Path, h100_on_demand: float) -> str:
  path.write_text(json.dumps({"prices": [
      {"accelerator": "v5e", "dollars": {"on_demand": 1.2, "spot": 0.6},
       "source": "test quote", "as_of": "2026-12-01"},
      {"accelerator": "h100", "dollars": {"on_demand": h100_on_demand, "spot": 4.0},
       "source": "test quote", "as_of": "2026-12-01"}]}))
  return f"--prices={path}"


@pytest.fixture(scope="module")
def ranked(tmp_path_factory):
  folder = tmp_path_factory.mktemp("cost")
  result = cost(CONFIG, "--tokens=1e11", "--targets=v5e-16,h100x16",
                "--pricing=on_demand,spot", _prices(folder / "p.json", 11.0),
                "--spot_mtbf_h=5", "--restart_min=12", "--deadline=2d",
                f"--json={folder / 'cost.json'}", f"--png={folder / 'cost.png'}")
  assert result.returncode == 0, result.stdout + result.stderr
  return folder, result, json.loads((folder / "cost.json").read_text())


def test_the_ranking_table_json_and_plot(ranked):
  folder, result, data = ranked
  rows = data["ranked"]
  assert [(r["target"], r["mode"]) for r in rows] == sorted(
      [(r["target"], r["mode"]) for r in rows],
      key=lambda k: next(r["dollars"] for r in rows if (r["target"], r["mode"]) == k))
  assert {(r["target"], r["mode"]) for r in rows} == {
      ("v5litepod-16", "on_demand"), ("v5litepod-16", "spot"), ("h100x16", "on_demand"),
      ("h100x16", "spot")}
  for r in rows:
    # Time and dollars follow from the step estimate, the price and the goodput formula.
    step = r["step"]
    assert r["tokens_per_second"] == pytest.approx(step["tokens_per_step"] / step["total_s"])
    checkpoint_h = 100 * step["total_s"] / 3600   # train.checkpoint_every of experiments/lm.py
    expected = economics.goodput(5.0, checkpoint_h, 0.2) if r["mode"] == "spot" else 1.0
    assert r["goodput"] == pytest.approx(expected, rel=1e-9)
    assert r["dollars"] == pytest.approx(
        1e11 / r["tokens_per_second"] / r["goodput"] / 3600 * r["chips"]
        * r["dollars_per_chip_hour"], rel=1e-9)
    assert 0 < step["mfu"] <= 1.0, r
    assert step["memory_bytes"] <= step["hbm_bytes"]
  assert any(r["pareto"] for r in rows)
  assert (folder / "cost.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  output = result.stdout
  assert "ranked by dollars" in output and "prices of v5e, h100: test quote, read 2026-12-01" \
      in output, output
  assert "chips by deadline" in output
  # The shape it ranked, with its parameter count (issue 62: a custom shape never said it).
  assert "model: 1.2" in result.stderr + output and " B parameters: d_model " in \
      result.stderr + output


def test_the_plot_names_the_shape_draws_the_deadline_and_keeps_labels_apart(monkeypatch,
                                                                            tmp_path):
  from experiments import lm  # pylint: disable=g-import-not-at-top
  from toolkit.planning.cost import report  # pylint: disable=g-import-not-at-top
  from toolkit.training import metrics  # pylint: disable=g-import-not-at-top
  config = lm.get_config("size=1b")
  config.model.n_layers = 3  # a custom shape
  shape = report.model_shape(config)
  assert ", 3 layers," in shape and shape.endswith(f"sequence {config.data.seq_len}")
  figures = []
  monkeypatch.setattr(metrics, "save_figure", lambda fig, path: figures.append(fig))
  option = lambda target, mode, hours, dollars: economics.Option(  # noqa: E731
      target=target, mode=mode, chips=8, tokens_per_second=1e11 / (hours * 3600), goodput=1.0,
      dollars_per_chip_hour=dollars / (hours * 8), tokens=1e11)
  options = [option("a", "on_demand", 100.0, 1e4), option("b", "on_demand", 101.0, 1.01e4),
             option("c", "spot", 400.0, 5e3)]
  report.plot(options, options[:1], str(tmp_path / "p.png"), f"lm ({shape}): 1e+11 tokens",
              deadline_h=48.0)
  ax = figures[-1].axes[0]
  assert "3 layers" in ax.get_title()
  assert any(line.get_label() == "deadline: 2 days" for line in ax.get_lines())
  offsets = [text.xyann for text in ax.texts]
  assert offsets[0] != offsets[1] and offsets[2] == offsets[0]  # a and b close; c alone


def test_a_cheaper_price_moves_a_target_up(ranked, tmp_path):
  _, _, data = ranked
  before = [(r["target"], r["mode"]) for r in data["ranked"]]
  assert before.index(("h100x16", "on_demand")) > before.index(("v5litepod-16", "on_demand"))
  result = cost(CONFIG, "--tokens=1e11", "--targets=v5e-16,h100x16", "--pricing=on_demand",
                _prices(tmp_path / "p.json", 0.5), f"--json={tmp_path / 'c.json'}")
  assert result.returncode == 0, result.stderr
  after = [r["target"] for r in json.loads((tmp_path / "c.json").read_text())["ranked"]]
  assert after == ["h100x16", "v5litepod-16"]


def test_write_prices_writes_the_shipped_table(tmp_path):
  result = cost(f"--write_prices={tmp_path / 'prices.json'}")
  assert result.returncode == 0, result.stderr
  rows = json.loads((tmp_path / "prices.json").read_text())["prices"]
  assert all(r["source"] and r["as_of"] for r in rows) and len(rows) >= 5


@pytest.mark.parametrize("args, fragments", [
    (["--tokens=1e12", "--targets=h100x12"], ["h100x12", "not whole 8-GPU nodes", "h100x16"]),
    (["--tokens=1e12", "--targets=v5p-7"], ["v5p-7", "v5p-N with N in"]),
    (["--tokens=1e12", "--deadline=fortnight"], ["--deadline='fortnight'", "14d"]),
    (["--tokens=1e12", "--pricing=monthly"], ["--pricing: 'monthly' is unknown"]),
    (["--tokens=1e12", "--prices=missing.json"], ["--prices=missing.json does not exist",
                                                  "--write_prices"]),
    ([], ["--tokens is required"]),
])
def test_mistakes_are_one_error_line(args, fragments):
  result = cost(CONFIG, *args)
  assert result.returncode == 2
  line = the_error_line(result)
  for fragment in fragments:
    assert fragment in line, line


def test_a_bad_price_file_is_one_error_line(tmp_path):
  (tmp_path / "p.json").write_text('[{"accelerator": "v5e", "dollars": {"spot": 0}, '
                                   '"source": "s", "as_of": "2026-12"}]')
  line = the_error_line(cost(CONFIG, "--tokens=1e12", f"--prices={tmp_path / 'p.json'}"))
  assert "row 1: dollars.spot=0" in line, line
