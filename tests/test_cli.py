"""The command line, through its entry point (``python -m planner``) and ``planner.cli.main``."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from planner import cli

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--arg", "layers=2", "--arg", "d_model=64", "--arg", "seq=32", "--arg", "batch=2"]


def run(*argv, cwd=None):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, "-m", "planner", *argv],
        capture_output=True, text=True, cwd=cwd or ROOT, env=env, timeout=300,
    )  # fmt: skip


def test_entry_point_plans_a_zoo_model_and_saves_json(tmp_path):
    out = tmp_path / "plan.json"
    result = run("plan", "gpt", *SMALL, "--budget-gb", "1", "--json", str(out))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Plan: ")
    assert "predicted peak" in result.stdout and "budget" in result.stdout
    assert json.loads(out.read_text())["format"] == "planner.plan"


def test_entry_point_help_documents_every_option():
    result = run("plan", "--help")
    assert result.returncode == 0
    for option in ("--budget-gb", "--budget-bytes", "--json", "--solver", "--arg", "--draw",
                   "--memory-plot", "--html", "MODULE:FACTORY"):  # fmt: skip
        assert option in result.stdout
    assert run("--help").returncode == 0


def test_entry_point_bad_input_is_one_line_without_traceback():
    result = run("plan", "no_such_model", "--budget-gb", "1")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().count("\n") == 0
    assert result.stderr.startswith("planner: error: unknown model 'no_such_model'")


def test_main_module_factory_and_outputs(tmp_path, capsys):
    status = cli.main([
        "plan", "planner.zoo:gpt", *SMALL, "--budget-bytes", str(2**30), "--solver", "sqrt_n",
        "--json", str(tmp_path / "p.json"), "--html", str(tmp_path / "p.html"),
    ])  # fmt: skip
    out = capsys.readouterr().out
    assert status == 0
    assert "solver sqrt_n" in out
    assert json.loads((tmp_path / "p.json").read_text())["solver"] == "sqrt_n"
    assert "<div" in (tmp_path / "p.html").read_text()


def test_main_pictures(tmp_path):
    pytest.importorskip("matplotlib")
    status = cli.main(["plan", "mlp", "--arg", "depth=4", "--budget-gb", "1", "--quiet",
                       "--draw", str(tmp_path / "g.png"),
                       "--memory-plot", str(tmp_path / "m.png")])  # fmt: skip
    assert status == 0
    assert (tmp_path / "g.png").stat().st_size > 0 and (tmp_path / "m.png").stat().st_size > 0


def test_main_factory_from_a_file(tmp_path, capsys):
    (tmp_path / "my_models.py").write_text(
        "import torch\n"
        "def make(width=8):\n"
        "    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(),\n"
        "                                torch.nn.Linear(width, 1))\n"
        "    return model, torch.randn(4, width)\n"
    )
    status = cli.main(["plan", f"{tmp_path / 'my_models.py'}:make", "--arg", "width=16",
                       "--budget-gb", "1"])  # fmt: skip
    assert status == 0
    assert "Plan:" in capsys.readouterr().out


def test_a_factory_file_imports_the_files_beside_it(tmp_path, capsys):
    """Found by a tester: ``python -m planner plan path/to/models.py:make`` could not import
    a helper module beside ``models.py``, as ``python path/to/models.py`` can."""
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "helpers_beside_xyz.py").write_text("WIDTH = 16\n")
    (folder / "models.py").write_text(
        "import torch\n"
        "from helpers_beside_xyz import WIDTH\n"
        "def make():\n"
        "    return torch.nn.Sequential(torch.nn.Linear(WIDTH, 1)), torch.randn(4, WIDTH)\n"
    )
    assert cli.main(["plan", f"{folder / 'models.py'}:make", "--budget-gb", "1"]) == 0
    assert "Plan:" in capsys.readouterr().out


def test_an_unknown_solver_gets_advice_the_command_line_can_follow(capsys):
    """Found by a tester: the message said to pass a callable, which no command line can."""
    assert cli.main(["plan", "mlp", "--budget-gb", "1", "--solver", "nope"]) == 2
    error = capsys.readouterr().err
    assert "unknown solver 'nope'" in error and "planner.solvers.register" in error
    assert "callable" not in error


def test_two_outputs_on_one_path_are_refused_before_planning(tmp_path, capsys, monkeypatch):
    """Found by a tester: ``--json x --html x`` wrote the HTML over the plan file."""
    monkeypatch.setattr("planner.plan", None)  # planning would fail: it must not be reached
    same = str(tmp_path / "plan.out")
    assert cli.main(["plan", "mlp", "--budget-gb", "1", "--json", same, "--html", same]) == 2
    assert "--json and --html name the same file" in capsys.readouterr().err


def test_a_reader_that_closes_the_pipe_early_costs_no_file_and_no_error(tmp_path):
    """Found by a tester: ``... --json p.json | head -1`` exited 1 with a BrokenPipeError and
    in 3 runs of 4 wrote no file: the summary was printed before the files were written."""
    out = tmp_path / "plan.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    argv = ["plan", "gpt", *SMALL, "--budget-gb", "1", "--json", str(out)]
    command = subprocess.Popen(
        [sys.executable, "-m", "planner", *argv],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT, env=env,
    )  # fmt: skip
    command.stdout.close()  # the reader is gone before the command prints anything
    assert command.wait(timeout=300) == 0, command.stderr.read().decode()
    assert json.loads(out.read_text())["format"] == "planner.plan"


@pytest.mark.parametrize(
    "argv, status, message",
    [
        (["plan", "gpt", *SMALL, "--budget-bytes", "100"], 1, "no plan fits a budget"),
        (["plan", "gpt", "--budget-gb", "-1"], 2, "finite positive"),
        (["plan", "gpt", "--budget-gb", "1", "--solver", "nope"], 2, "unknown solver 'nope'"),
        (["plan", "gpt", "--budget-gb", "1", "--arg", "layerz=2"], 2, "unexpected keyword"),
        (["plan", "gpt", "--budget-gb", "1", "--arg", "oops"], 2, "KEY=VALUE"),
        (["plan", "planner.zoo:nothing", "--budget-gb", "1"], 2, "no attribute 'nothing'"),
        (["plan", "no_such_pkg_xyz:f", "--budget-gb", "1"], 2, "cannot import"),
        (["plan", "planner.zoo:MODELS", "--budget-gb", "1"], 2, "not callable"),
        (["plan", "planner.zoo:gpt_config_7b", "--budget-gb", "1"], 2, "must return"),
    ],
)
def test_main_errors(argv, status, message, capsys):
    assert cli.main(argv) == status
    err = capsys.readouterr().err
    assert err.startswith("planner: error: ") and message in err
    assert err.strip().count("\n") == 0


def test_a_factory_that_raises_is_named_with_its_error(tmp_path, capsys):
    """A ValueError of the user's own factory read as a bad budget, its bare message alone
    (found trying the library)."""
    (tmp_path / "my_models.py").write_text("def make():\n    raise ValueError('no data')\n")
    spec = f"{tmp_path / 'my_models.py'}:make"
    assert cli.main(["plan", spec, "--budget-gb", "1"]) == 1
    err = capsys.readouterr().err
    assert err == (
        f"planner: error: the factory {spec} raised ValueError: no data "
        "(run with --traceback for details)\n"
    )
    with pytest.raises(cli.FactoryFailed) as raised:
        cli.main(["plan", spec, "--budget-gb", "1", "--traceback"])
    assert isinstance(raised.value.__cause__, ValueError)


def test_a_factory_whose_third_item_is_not_a_dict_is_a_bad_factory_result(tmp_path, capsys):
    """Exit status 2, as cli.md says of a bad factory result (it was 1, from deep in plan)."""
    (tmp_path / "my_models.py").write_text(
        "import torch\ndef make():\n    return torch.nn.Linear(3, 3), (torch.randn(2, 3),), [1]\n"
    )
    assert cli.main(["plan", f"{tmp_path / 'my_models.py'}:make", "--budget-gb", "1"]) == 2
    assert "returned list as its third item; it must be" in capsys.readouterr().err


def test_a_type_error_inside_the_factory_is_the_factorys_not_the_command_lines(tmp_path, capsys):
    """Found trying the library: any TypeError read as bad --arg values (status 2, or 1 with
    --traceback). Only arguments its signature refuses are."""
    (tmp_path / "my_models.py").write_text(
        "import torch\ndef make(width=4):\n    return torch.nn.Linear(4, 4), torch.randn('8', 4)\n"
    )
    spec = f"{tmp_path / 'my_models.py'}:make"
    assert cli.main(["plan", spec, "--budget-gb", "1"]) == 1
    assert f"the factory {spec} raised TypeError" in capsys.readouterr().err
    assert cli.main(["plan", spec, "--budget-gb", "1", "--arg", "depth=2"]) == 2
    assert "unexpected keyword argument 'depth'" in capsys.readouterr().err


def test_main_usage_errors_return_2_and_help_0(capsys):
    """``main`` returns the status (found by a tester: argparse's exit escaped it)."""
    assert cli.main(["plan", "gpt"]) == 2  # no budget
    assert "--budget-gb" in capsys.readouterr().err
    assert cli.main(["plan", "gpt", "--budget-gb", "1", "--budget-bytes", "5"]) == 2
    assert cli.main(["plan", "gpt", "--budget-gb", "x"]) == 2
    assert cli.main(["--help"]) == 0


def test_traceback_flag_reraises():
    with pytest.raises(cli.UsageError):
        cli.main(["plan", "planner.zoo:nothing", "--budget-gb", "1", "--traceback"])


def test_entry_point_syntax_error_in_the_model_file_exits_2(tmp_path):
    """docs/cli.md: a bad model spec or factory is status 2, with one line."""
    (tmp_path / "broken.py").write_text("def make(:\n    pass\n")
    result = run("plan", f"{tmp_path / 'broken.py'}:make", "--budget-gb", "1")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().count("\n") == 0 and "Traceback" not in result.stderr
    assert result.stderr.startswith("planner: error: cannot load")
    assert "syntax error in" in result.stderr and "line 1" in result.stderr


def test_syntax_error_in_an_imported_model_module_exits_2(tmp_path, monkeypatch, capsys):
    (tmp_path / "broken_models_xyz.py").write_text("x = = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert cli.main(["plan", "broken_models_xyz:make", "--budget-gb", "1"]) == 2
    assert "syntax error in" in capsys.readouterr().err


@pytest.mark.parametrize("option", ["--json", "--html", "--draw", "--memory-plot"])
def test_output_paths_are_checked_before_planning(option, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("planner.plan", None)  # planning would fail: it must not be reached
    assert cli.main(["plan", "mlp", "--budget-gb", "1", option, str(tmp_path)]) == 2
    assert f"{option} {tmp_path} is a directory" in capsys.readouterr().err
    assert cli.main(["plan", "mlp", "--budget-gb", "1", option, str(tmp_path / "no" / "f")]) == 2
    assert "there is no directory" in capsys.readouterr().err


@pytest.mark.parametrize("option", ["--draw", "--memory-plot"])
def test_a_figure_format_matplotlib_cannot_write_is_refused_before_planning(
    option, tmp_path, capsys, monkeypatch
):
    """Found trying the library: ``--draw graph.txt`` planned, printed the plan, then failed
    in matplotlib with exit status 1."""
    pytest.importorskip("matplotlib")
    monkeypatch.setattr("planner.plan", None)  # planning would fail: it must not be reached
    assert cli.main(["plan", "mlp", "--budget-gb", "1", option, str(tmp_path / "f.txt")]) == 2
    assert "format comes from the file's suffix, and .txt is none" in capsys.readouterr().err
