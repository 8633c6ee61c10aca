"""The native kernels' build cache loads only a library this user built: one that another
user owns, or that others may write, is built anew over (it would run in every kvray
process). The C compiler is replaced by a test double: the cache's policy is under test."""

from __future__ import annotations

import os
import shutil

import pytest

from kvray.kernels import cpu_build


@pytest.fixture
def compiler(tmp_path, monkeypatch) -> list:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("KVRAY_CACHE", str(tmp_path))
    built: list = []

    def compile_(compiler: str, out) -> None:
        out.write_bytes(b"built by this user")
        built.append(out)

    monkeypatch.setattr(cpu_build, "_compile", compile_)
    return [cc, built]


def _planted(cc: str, mode: int):
    """A file where the build would go, not built by kvray."""
    target = cpu_build._target(cc)
    target.parent.mkdir(parents=True)
    target.write_bytes(b"planted")
    os.chmod(target, mode)
    return target


def test_a_library_others_may_write_is_built_anew(compiler):
    cc, built = compiler
    target = _planted(cc, 0o777)
    assert not cpu_build.trusted(target)
    assert cpu_build._build(cc) == target
    assert target.read_bytes() == b"built by this user" and cpu_build.trusted(target)
    assert oct(target.stat().st_mode & 0o777) == "0o755"
    assert cpu_build._build(cc) == target and len(built) == 1  # a trusted build is reused


@pytest.mark.skipif(os.getuid() != 0, reason="making a file of another user's needs root")
def test_a_library_another_user_owns_is_built_anew(compiler):
    cc, built = compiler
    target = _planted(cc, 0o755)
    os.chown(target, 65534, 65534)  # nobody's
    assert not cpu_build.trusted(target)
    assert cpu_build._build(cc) == target
    assert target.stat().st_uid == os.getuid() and target.read_bytes() == b"built by this user"


def test_a_link_or_a_folder_others_may_write_is_never_trusted(compiler, tmp_path):
    cc, built = compiler
    target = cpu_build._target(cc)
    target.parent.mkdir(parents=True)
    own = tmp_path / "own.so"
    own.write_bytes(b"a file of this user's")
    os.chmod(own, 0o755)
    target.symlink_to(own)  # a link, even to a file of this user's: built anew over
    assert not cpu_build.trusted(target)
    assert cpu_build._build(cc) == target and not target.is_symlink() and len(built) == 1
    os.chmod(target.parent, 0o777)  # others may swap files in the folder
    assert not cpu_build.trusted(target)
    with pytest.raises(RuntimeError, match="others may write"):
        cpu_build._build(cc)
