"""A rank's log (orchestrator/rank_logs.py): in the check directory when the rank runs on the driver's
node, else a temporary file whose text travels back in the rank's result and which is then removed."""

from orchestrator.rank_logs import rank_log


def test_a_log_kept_off_the_check_directory_travels_back_and_leaves_no_file():
    with rank_log({"log": {}}, 3) as log:
        log.write("hello\n", stderr=True)
        where, directory = log.where(), log.path.parent
        assert directory.is_dir() and log.path.name == "rank00003.log"
    assert where == {"text": "hello\n"}
    assert not directory.exists()   # until 2026-11-29 every such rank left one in /tmp


def test_a_log_in_the_check_directory_stays(tmp_path):
    with rank_log({"log": {"dir": str(tmp_path)}}, 0) as log:
        log.write("kept\n", stderr=False)
        assert log.where() == {"path": str(tmp_path / "rank00000.log")}
    assert (tmp_path / "rank00000.log").read_text() == "kept\n"
