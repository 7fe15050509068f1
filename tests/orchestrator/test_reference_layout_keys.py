"""`reference.parallel`: resolved like a `parallel=<name>` option (ttrace's recipes and the user's config
dirs), part of the reference cache key, refused when unknown, and described in report.json."""

import pytest

from orchestrator import layouts
from orchestrator.recipe import compose, reference_key, validate
from tracer.errors import ConfigError


def test_a_name_resolves_to_the_parallel_recipe():
    rec = compose(["parallel=tp2_pp2", "reference.parallel=tp2"])
    assert rec["reference"]["parallel"] == {**compose(["parallel=tp2"])["parallel"], "zero1": False, "vpp": 1,
                                            "cp": 1, "ep": 1}
    validate(rec)
    assert layouts.reference_layout(compose([]))["world_size"] == 1   # default: one device


def test_a_user_config_dir_is_searched(tmp_path):
    (tmp_path / "parallel").mkdir()
    (tmp_path / "parallel" / "mine.yaml").write_text("name: mine\nworld_size: 2\ntp: 2\n")
    rec = compose(["reference.parallel=mine"], config_dirs=[str(tmp_path)])
    assert rec["reference"]["parallel"]["name"] == "mine" and rec["reference"]["parallel"]["tp"] == 2


def test_an_unknown_name_or_key_is_refused_naming_it():
    with pytest.raises(ConfigError, match=r"reference.parallel=tp3: no parallel recipe.*options: .*tp2_sp"):
        validate(compose(["reference.parallel=tp3"]))
    with pytest.raises(ConfigError, match=r"reference.parallel.tpp"):
        validate(compose(["reference.parallel={world_size:2,tpp:2}"]))


def test_a_layout_the_model_cannot_take_is_refused_as_the_reference_layout():
    with pytest.raises(ConfigError, match=r"reference.parallel=tp3 .*not divisible by tp=3"):
        validate(compose(["parallel=tp2", "reference.parallel={world_size:3,tp:3}"]))


def test_the_cache_key_covers_the_reference_layout():
    single = reference_key(compose(["parallel=tp2_pp2"]))
    tp2 = reference_key(compose(["parallel=tp2_pp2", "reference.parallel=tp2"]))
    assert tp2 != single
    assert reference_key(compose(["parallel=tp2_sp", "reference.parallel=tp2"])) == tp2   # any candidate
    # the sizes count, not the name: a section with tp2's sizes is tp2's reference, `single` is the default
    assert reference_key(compose(["parallel=tp2", "reference.parallel={name:x,world_size:2,tp:2}"])) == tp2
    assert reference_key(compose(["parallel=tp2_pp2", "reference.parallel=single"])) == single
    assert reference_key(compose(["reference.parallel=tp2_sp"])) != tp2


def test_the_report_says_what_was_trusted():
    def said(candidate, reference):
        rec = compose([f"parallel={candidate}", f"reference.parallel={reference}"])
        return layouts.report(rec["parallel"], layouts.reference_layout(rec))

    r = said("tp2_pp2", "tp2")
    assert r["parallel"] == {"name": "tp2", "world_size": 2, "sizes": {"tp": 2}}
    assert r["trusted"] == ("the reference layout tp2 (tp=2) is trusted; only what the candidate tp2_pp2 "
                            "adds (pp=2) is under test")
    wider = said("tp2", "tp2_sp")["trusted"]
    assert "not a subset" in wider and "it has sp" in wider
    assert "share no parallel dimension" in said("pp2", "tp2")["trusted"]
    assert "one device is trusted" in said("tp2", "single")["trusted"]
