"""Argparse arguments generated from config dataclasses (omnibal.cli.fields)."""

from __future__ import annotations

import argparse
import dataclasses
import enum

import pytest

from omnibal.cli.fields import add_config_arguments, config_from_args, field_docs


class Colour(enum.StrEnum):
    RED = "red"
    BLUE = "blue"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Inner:
    width: int = 1
    """Width."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Toy:
    inner: Inner = dataclasses.field(default_factory=lambda: Inner(width=2))
    """Nested: its fields appear flat."""
    max_tiles: int | None = None
    """Tile cap per image (100% of them)."""
    colour: Colour = Colour.RED
    """Which colour."""
    chunks: tuple[int, ...] = (1,)
    """Chunks per stage."""
    prefetch: bool = False
    """Load ahead."""
    num_steps: int = dataclasses.field(default=10, metadata={"flag": "--steps", "short": "-n"})
    """Optimizer steps."""
    hidden: str = dataclasses.field(default="x", metadata={"cli": False})
    """Not a flag."""


def _parser():
    p = argparse.ArgumentParser()
    return p, add_config_arguments(p, Toy)


def test_flags_help_and_types_come_from_the_fields():
    p, flags = _parser()
    assert flags == {"width": "--width", "max_tiles": "--max-tiles", "colour": "--colour",
                     "chunks": "--chunks", "prefetch": "--prefetch", "num_steps": "--steps"}
    text = p.format_help()
    assert "Tile cap per image (100% of them)." in text and "{red,blue}" in text and "-n" in text
    args = p.parse_args(["--max-tiles", "6", "--colour", "blue", "--chunks", "2,3", "--prefetch", "-n", "4",
                         "--width", "2"])
    assert (args.max_tiles, args.colour, args.chunks, args.prefetch, args.num_steps, args.width) == (
        6, "blue", (2, 3), True, 4, 2)
    with pytest.raises(SystemExit):
        p.parse_args(["--colour", "green"])


def test_help_names_a_plain_default_of_the_config_itself():
    p, _ = _parser()
    text = " ".join(p.format_help().split())
    assert "Optimizer steps. (default: 10)" in text and "Which colour. (default: red)" in text
    assert "Chunks per stage. (default: 1)" in text
    assert "Width. (default" not in text  # a nested config's default need not be the outer one's
    assert "Load ahead. (default" not in text  # a flag's bool
    p = argparse.ArgumentParser()
    add_config_arguments(p, WithOwnDefaults)
    assert "Width. (default: 1)" in " ".join(p.format_help().split())  # the nested class's own default stands


@dataclasses.dataclass(frozen=True, kw_only=True)
class WithOwnDefaults:
    inner: Inner = dataclasses.field(default_factory=Inner)
    """Nested, its class's own default: the nested defaults are the command line's."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class WithSomeOf:
    layout: Toy = dataclasses.field(metadata={"fields": {"max_tiles": None, "num_steps": "steps of this job"},
                                              "cli_default": Toy(num_steps=3)})
    """Only two of Toy's fields, from another base than Toy's defaults."""


def test_a_nested_config_may_offer_some_of_its_fields_from_a_base_of_its_own():
    from omnibal.cli.fields import cli_fields

    p = argparse.ArgumentParser()
    assert add_config_arguments(p, WithSomeOf) == {"max_tiles": "--max-tiles", "num_steps": "--steps"}
    assert "steps of this job" in p.format_help()
    assert [doc for _, _, doc in cli_fields(WithSomeOf)] == ["Tile cap per image (100% of them).", "steps of this job"]
    assert config_from_args(WithSomeOf, p.parse_args([])) == WithSomeOf(layout=Toy(num_steps=3))
    assert config_from_args(WithSomeOf, p.parse_args(["--max-tiles", "5"])) == WithSomeOf(
        layout=Toy(num_steps=3, max_tiles=5))
    with pytest.raises(SystemExit):
        p.parse_args(["--colour", "blue"])


def test_a_parsers_input_error_is_a_usage_error_with_its_own_message(capsys):
    from omnibal.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["plan", "--chunks", "1,x"])
    assert exc.value.code == 2
    assert "argument --chunks: must be comma-separated integers, got '1,x'" in capsys.readouterr().err


@dataclasses.dataclass(frozen=True, kw_only=True)
class WithParsed:
    inner: Inner = dataclasses.field(default_factory=Inner, metadata={"flag": "--inner-width",
                                                                      "parse": lambda t: Inner(width=int(t))})
    """A nested config given as one value."""
    width: int = 0
    """Another knob of the same name as the nested config's field."""


def test_a_nested_config_with_a_parser_is_one_argument():
    p = argparse.ArgumentParser()
    assert add_config_arguments(p, WithParsed) == {"inner": "--inner-width", "width": "--width"}
    assert config_from_args(WithParsed, p.parse_args(["--inner-width", "3", "--width", "5"])) == WithParsed(
        inner=Inner(width=3), width=5)
    assert config_from_args(WithParsed, p.parse_args(["--width", "5"])) == WithParsed(width=5)


def test_an_error_about_a_field_is_named_by_its_flag():
    from omnibal.cli.fields import errors_named_by_flags
    from omnibal.errors import InputError

    with pytest.raises(InputError, match="^--steps: field 'num_steps': too many$"):
        with errors_named_by_flags(Toy):
            raise InputError("too many", field="num_steps")
    with pytest.raises(InputError, match="^--width: field 'width': too wide$"):  # a nested config's field
        with errors_named_by_flags(Toy):
            raise InputError("too wide", field="width")
    with pytest.raises(InputError, match="^a.json: field 'num_steps': bad$"):  # a file it names stays named
        with errors_named_by_flags(Toy):
            raise InputError("bad", source="a.json", field="num_steps")


def test_unset_flags_keep_the_dataclass_defaults():
    p, _ = _parser()
    args = p.parse_args(["--no-prefetch"])
    assert vars(args) == {"prefetch": False}
    assert config_from_args(Toy, p.parse_args([])) == Toy()


def test_field_docs_reads_the_docstring_under_each_field():
    assert field_docs(Toy)["colour"] == "Which colour."
    assert field_docs(Toy)["hidden"] == "Not a flag."


def _generated():
    """subcommand -> ((config class, fields of it that are not flags), ...): the configs its parser is generated
    from. A field left out is named here with the reason."""
    from omnibal.cost.profile import ProfileConfig
    from omnibal.hbp.planning import HBPPlanConfig
    from omnibal.jobs.balance import BalanceJobConfig
    from omnibal.jobs.plan_config import PlanJobConfig
    from omnibal.jobs.simulate import SimulateJobConfig
    from omnibal.plan.search import SearchConfig
    from omnibal.stats.annotations import AnnotationConfig
    from omnibal.train.config import TrainConfig

    train = ((TrainConfig, ("tp_size", "zero_stage")),)  # the reference trainer has no TP and no ZeRO
    hbp_from_job = ("sp_degrees", "max_levels", "candidate_lengths", "oversize", "baseline_batch_size",
                    "dtype_bytes", "sp_by_simulator", "length_search", "length_search_rounds", "progress")
    return {"train": train, "torchrun -m omnibal train": train,
            "plan": ((PlanJobConfig, ()),
                     (SearchConfig, ("seed",)),  # the job's --seed
                     # --hbp takes these from the plan job (batch size, oversize, --quiet) or keeps their defaults
                     (HBPPlanConfig, hbp_from_job)),
            "simulate": ((SimulateJobConfig, ()),),
            "balance": ((BalanceJobConfig, ()),),
            "profile": ((ProfileConfig, ()),),
            "stats": ((AnnotationConfig, ()),)}


CLI_ONLY = {
    # how many local processes to start: the launcher's, not the run's
    "train": ("nproc",), "torchrun -m omnibal train": ("nproc",),
    # --hbp: another job (HBP's levels) instead of the plan; --verify/--verify-steps: a measurement after
    # planning (omnibal.measure.verify); the rest: where and how loudly the outputs are written
    "plan": ("hbp", "verify", "verify_steps", "out", "no_timelines", "quiet"),
    # --online-vs-offline: another comparison instead of the simulation; --no-report: out=None
    "simulate": ("online_vs_offline", "no_report", "quiet"),
    # where and how loudly the outputs are written
    "balance": ("out", "metrics_json", "plot", "quiet"),
    # the model measured (a preset or a spec file) is measure()'s argument, not a setting; the rest are outputs
    "profile": ("model", "spec", "out", "quiet"),
    # --summary/--convert/--synthetic (with its --seed): other modes than counting annotations; --hf-model: the
    # checkpoint whose image settings replace the config's; --convention: a preset of the tile settings (and
    # the target of --convert); the rest: where the outputs go, in which format, how loudly
    "stats": ("summary", "convert", "synthetic", "seed", "hf_model", "convention", "out", "format", "input_format",
              "report", "plot", "quiet"),
}
"""The flags of a generated subcommand that are no config field: purely command-line matters."""


def _parsers() -> dict[str, argparse.ArgumentParser]:
    from test_cli_flags import PARSERS

    return PARSERS


@pytest.mark.parametrize("command", list(CLI_ONLY))
def test_every_config_field_has_one_flag_and_every_flag_one_field(command):
    from omnibal.cli.fields import cli_fields, option_key

    parser = _parsers()[command]
    dests = [a.dest for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]
    fields = [option_key(f) or f.name for cls, skip in _generated()[command] for f, _, _ in cli_fields(cls)
              if f.name not in skip]
    assert sorted(dests) == sorted([*fields, *CLI_ONLY[command]])
    assert len(set(dests)) == len(dests)


def test_a_shared_knob_is_spelled_the_same_in_every_generated_subcommand():
    """A field name two configs share, or two fields spelled by one shared option, has one flag everywhere."""
    import typing

    from omnibal.cli.fields import cli_fields, flag_of, option_key
    from omnibal.cli.options import OPTIONS

    flags: dict[str, set] = {}
    for configs in _generated().values():
        for cls, skip in configs:
            for f, tp, _ in cli_fields(cls):
                if f.name in skip:
                    continue
                assert typing.get_origin(tp) is not typing.Literal, f"{cls.__name__}.{f.name}: use a StrEnum"
                key = option_key(f)
                flag = OPTIONS[key].flag if key else flag_of(f)
                flags.setdefault(f.name, set()).add(flag)
                if key:
                    flags.setdefault(f"option {key}", set()).add(flag)
    # selective: the trainer's per-stage sets of selectively recomputed layers vs the planner's on/off switch
    different = {"selective": {"--selective", "--selective-recompute"}}
    assert {name: f for name, f in flags.items() if len(f) > 1} == different


def test_train_flags_build_the_config_the_fields_describe():
    from omnibal.cli.train import add_arguments, train_config

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cfg = train_config(parser.parse_args(["--steps", "3", "--stage-layers", "0:4", "--recompute", "a,b",
                                          "--pp-schedule", "gpipe", "--batch-size", "2", "--log", "m.jsonl",
                                          "--convert-stats", "--dp", "2", "--threads", "2"]))
    assert (cfg.num_steps, cfg.stage_layers, cfg.recompute, cfg.pp_schedule, cfg.baseline_batch_size,
            cfg.log_path, cfg.convert_stats, cfg.layout.dp_size, cfg.torch_threads) == (
        3, ((0, 4),), (("a", "b"),), "gpipe", 2, "m.jsonl", True, 2, 2)
    assert train_config(parser.parse_args([])) == train_config(parser.parse_args([])).__class__()


def _vocabularies(root):
    """(place, values) of every StrEnum of the package, and of every module-level tuple/list/set of two or
    more string literals bound to an upper-case name that is used as a choice list: a ``choices=`` keyword,
    a ``"choices"`` metadata entry or the vocabulary of ``check_choice``."""
    import ast

    enums, lists, used = [], {}, set()

    def name_of(node):
        return getattr(node, "id", getattr(node, "attr", None))

    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and any(name_of(b) == "StrEnum" for b in node.bases):
                values = [s.value.value for s in node.body if isinstance(s, ast.Assign)
                          and isinstance(s.value, ast.Constant) and isinstance(s.value.value, str)]
                enums.append((f"{path.relative_to(root)}:{node.lineno} {node.name}", frozenset(values)))
            elif isinstance(node, ast.keyword) and node.arg == "choices":
                used.add(name_of(node.value))
            elif isinstance(node, ast.Dict):
                used.update(name_of(v) for k, v in zip(node.keys, node.values)
                            if isinstance(k, ast.Constant) and k.value == "choices")
            elif isinstance(node, ast.Call) and name_of(node.func) == "check_choice" and len(node.args) > 1:
                used.add(name_of(node.args[1]))
        for node in tree.body:
            target, value = ((node.targets[0], node.value) if isinstance(node, ast.Assign) else
                             (node.target, node.value) if isinstance(node, ast.AnnAssign) else (None, None))
            if (isinstance(target, ast.Name) and target.id.isupper()
                    and isinstance(value, (ast.Tuple, ast.List, ast.Set)) and len(value.elts) > 1
                    and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in value.elts)):
                lists[target.id] = (f"{path.relative_to(root)}:{node.lineno} {target.id}",
                                    frozenset(e.value for e in value.elts))
    return enums, [place_values for name, place_values in lists.items() if name in used]


def test_no_choice_list_is_defined_twice():
    """A vocabulary has one spelling in the source: a StrEnum, or one named list; no two of them hold the
    same words, no string tuple/list/set literal anywhere repeats an enum's values, and no ``choices=`` is
    a literal."""
    import ast
    import pathlib

    import omnibal

    root = pathlib.Path(omnibal.__file__).parent
    enums, lists = _vocabularies(root)
    by_values: dict[frozenset, list[str]] = {}
    for place, values in [*enums, *lists]:
        by_values.setdefault(values, []).append(place)
    assert {v: p for v, p in by_values.items() if len(p) > 1} == {}
    enum_values = {values: place for place, values in enums}
    copies, literal_choices = [], []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and len(node.elts) > 1 and all(
                    isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts):
                values = frozenset(e.value for e in node.elts)
                if values in enum_values:
                    copies.append(f"{path.relative_to(root)}:{node.lineno} repeats {enum_values[values]}")
            if (isinstance(node, ast.keyword) and node.arg == "choices"
                    and isinstance(node.value, (ast.Tuple, ast.List, ast.Set))):
                literal_choices.append(f"{path.relative_to(root)}:{node.value.lineno}")
    assert copies == []
    assert literal_choices == []
