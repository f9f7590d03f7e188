"""glibc's huge-page tunable for the `pockjax` command (`pockjax/_src/malloc.py`): when
it applies, how it joins the user's own tunables, and the command starting itself again
with it, once."""
import subprocess
import sys

import pytest

from pockjax._src import malloc


@pytest.fixture
def linux_with_thp(monkeypatch):
    """A Linux glibc 2.36 with transparent huge pages on request, whatever this host is."""
    monkeypatch.setattr(malloc.sys, "platform", "linux")
    monkeypatch.setattr(malloc, "_glibc_version", lambda: (2, 36))
    monkeypatch.setattr(malloc, "thp_mode", lambda: "madvise")


def test_the_tunable_joins_the_users_own(linux_with_thp):
    assert malloc.tuned_environ({})["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
    env = malloc.tuned_environ({"GLIBC_TUNABLES": "glibc.malloc.tcache_count=0", "A": "b"})
    assert env == {"GLIBC_TUNABLES": "glibc.malloc.tcache_count=0:glibc.malloc.hugetlb=1",
                   "A": "b"}


@pytest.mark.parametrize("environ", [
    {"POCKJAX_MALLOC": "system"},  # the user's opt-out
    {"POCKJAX_MALLOC": " System "},
    {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"},  # the user's own choice stands
])
def test_the_users_choice_stands(linux_with_thp, environ):
    assert malloc.tuned_environ(environ) is None


def test_a_mistyped_choice_names_the_two(linux_with_thp):
    assert malloc.tuned_environ({"POCKJAX_MALLOC": "hugepages"})["GLIBC_TUNABLES"] == \
        "glibc.malloc.hugetlb=1"
    with pytest.raises(ValueError, match="POCKJAX_MALLOC='sytem': set it to 'system'"):
        malloc.tuned_environ({"POCKJAX_MALLOC": "sytem"})


def test_the_command_stops_on_a_mistyped_choice():
    import os
    proc = subprocess.run([sys.executable, "-c", "from pockjax.cli import main; main()",
                           "targets"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "POCKJAX_MALLOC": "sytem"}, check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == (
        "pockjax: POCKJAX_MALLOC='sytem': set it to 'system' to keep the system's malloc "
        "settings, or 'hugepages' (the same as leaving it unset) for glibc's huge pages")


def test_nothing_changes_where_the_tunable_does_not_exist(linux_with_thp, monkeypatch):
    monkeypatch.setattr(malloc, "_glibc_version", lambda: (2, 34))  # before hugetlb
    assert malloc.tuned_environ({}) is None
    monkeypatch.setattr(malloc, "_glibc_version", lambda: None)  # musl, bionic
    assert malloc.tuned_environ({}) is None
    monkeypatch.setattr(malloc, "_glibc_version", lambda: (2, 36))
    monkeypatch.setattr(malloc, "thp_mode", lambda: "never")
    assert malloc.tuned_environ({}) is None
    monkeypatch.setattr(malloc.sys, "platform", "darwin")
    monkeypatch.setattr(malloc, "thp_mode", lambda: "madvise")
    assert malloc.tuned_environ({}) is None


def test_thethp_mode_is_read_from_the_kernels_line(tmp_path):
    path = tmp_path / "enabled"
    path.write_text("always [madvise] never\n")
    assert malloc.thp_mode(str(path)) == "madvise"
    path.write_text("[always] madvise never\n")
    assert malloc.thp_mode(str(path)) == "always"
    assert malloc.thp_mode(str(tmp_path / "missing")) is None


_SHOW = ("import os; from pockjax._src.malloc import restart_tuned; print('start', flush=True); "
         "restart_tuned(); print(os.environ.get('GLIBC_TUNABLES'))")


def _started(**env) -> list[str]:
    import os
    environ = {k: v for k, v in os.environ.items()
               if k not in ("GLIBC_TUNABLES", "POCKJAX_MALLOC", "POCKJAX_MALLOC_RESTARTED")}
    proc = subprocess.run([sys.executable, "-c", _SHOW], capture_output=True, text=True,
                          env={**environ, **env}, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()


def test_the_process_starts_again_once_with_the_tunable():
    """Where the tunable applies on this host, the process runs its start once more, with
    it; elsewhere it runs on as started."""
    if malloc.tuned_environ({}) is None:
        assert _started() == ["start", "None"]
    else:
        assert _started() == ["start", "start", "glibc.malloc.hugetlb=1"]
    assert _started(POCKJAX_MALLOC="system") == ["start", "None"]
    # Once only, even where glibc would not pass the tunable on.
    assert _started(POCKJAX_MALLOC_RESTARTED="1") == ["start", "None"]


def test_the_command_line_restarts_and_main_with_arguments_does_not(monkeypatch):
    import pockjax._src.malloc as m
    from pockjax.cli import main

    calls = []
    monkeypatch.setattr(m, "restart_tuned", lambda: calls.append(1))
    assert main(["targets"]) == 0
    assert calls == []
    monkeypatch.setattr(sys, "argv", ["pockjax", "targets"])
    assert main() == 0
    assert calls == [1]
