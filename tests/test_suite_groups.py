"""The test suite's ``--dist loadgroup`` groups (conftest.xdist_group): every test of one
registered family lands in one group whatever its file, and xdist can read every group
back from the node id, so each family's tiny model is built and compiled on one worker."""
from types import SimpleNamespace

import pytest

from conftest import xdist_group

FAMILIES = {"mamba": object(), "rwkv": object()}


def fake_item(module: str, nodeid: str, one_worker: bool = False, **params):
    return SimpleNamespace(module=SimpleNamespace(__name__=module, ONE_WORKER=one_worker), nodeid=nodeid,
                           callspec=SimpleNamespace(params=params) if params else None)


def group_xdist_reads(nodeid: str, group: str) -> str:
    """What xdist 3.8's LoadGroupScheduling takes as the scope of ``<nodeid>@<group>``: the
    text after the last ``@`` only when no ``]`` follows it, else the whole node id."""
    full = f"{nodeid}@{group}"
    return full.split("@")[-1] if full.rfind("@") > full.rfind("]") else full


def test_a_family_s_tests_share_a_group_across_files_and_xdist_reads_it():
    a = fake_item("test_conformance", "tests/test_conformance.py::test_parity[mamba]", fam="mamba")
    b = fake_item("test_hooks", "tests/test_hooks.py::test_cache[mamba]", fam="mamba")
    c = fake_item("test_hooks", "tests/test_hooks.py::test_cache[rwkv]", fam="rwkv")
    groups = [xdist_group(item, FAMILIES) for item in (a, b, c)]
    assert groups[0] == groups[1] != groups[2]
    for item, group in zip((a, b, c), groups):
        assert group_xdist_reads(item.nodeid, group) == group
    # the check above can fail: a bracketed name is read as a group of one test
    assert group_xdist_reads(a.nodeid, "family[mamba]") != "family[mamba]"


def test_model_fixture_groups_and_plain_tests():
    pair = fake_item("test_rwkv", "tests/test_rwkv.py::test_logits[untied_R2]", pair="untied_R2")
    plain = fake_item("test_ops", "tests/test_ops.py::test_scan")
    assert xdist_group(pair, FAMILIES) == "test_rwkv:untied_R2"
    assert xdist_group(plain, FAMILIES) == "test_ops"
    assert group_xdist_reads(pair.nodeid, "test_rwkv:untied_R2") == "test_rwkv:untied_R2"


def test_a_one_worker_file_keeps_its_family_named_tests():
    named = fake_item("test_kernel_export", "tests/test_kernel_export.py::test_export[mamba-cuda]", True, name="mamba")
    assert xdist_group(named, FAMILIES) == "test_kernel_export"
    assert xdist_group(fake_item("test_x", "tests/test_x.py::t[mamba]", name="mamba"), FAMILIES) == "family:mamba"


def test_a_group_name_xdist_cannot_read_is_refused():
    bad = fake_item("test_rwkv", "tests/test_rwkv.py::test_logits[x]", pair="x]")
    with pytest.raises(pytest.UsageError, match="holds"):
        xdist_group(bad, FAMILIES)
