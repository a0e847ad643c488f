"""External-weights exports in the service: crash-consistent like other checkpoints,
links revoked by overwrite and delete, signed tokens and file checks, worker-group engines."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from ember.service import NotFoundError
from ember.service.external import REFUSED, LinkSigner, export_files, load_secret, resolve_file

from .conftest import new_run, result


def _export(svc, mid, seq, name="ex"):
    return result(svc, "alice", svc.save_weights_external("alice", mid, seq, name))


def test_overwrite_and_delete_revoke_links_and_remove_files(make_service):
    svc = make_service()
    _, mid = new_run(svc, "alice")
    first = _export(svc, mid, 1)
    assert first.size_bytes == sum(f.stat().st_size for f in Path(svc.checkpoints.row(first.path).directory)
                                   .iterdir())
    old = svc.external_weights_links("alice", mid, "external_weights/ex")
    assert svc.open_external_weights_file(old.token, "adapter_config.json").startswith(old.directory)
    with pytest.raises(NotFoundError):  # another owner, same id
        svc.external_weights_links("bob", mid, "external_weights/ex")
    _export(svc, mid, 2)  # overwrite: a fresh directory, the old one removed, its links dead
    new = svc.external_weights_links("alice", mid, "external_weights/ex")
    assert new.directory != old.directory and not Path(old.directory).exists()
    with pytest.raises(NotFoundError, match=REFUSED):
        svc.open_external_weights_file(old.token, "adapter_config.json")
    svc.delete_checkpoint("alice", mid, "external_weights/ex")
    assert not Path(new.directory).exists()
    with pytest.raises(NotFoundError, match=REFUSED):
        svc.open_external_weights_file(new.token, "adapter_config.json")


def test_a_failed_export_leaves_nothing_after_restart(make_service):
    from ember import failpoints

    svc = make_service()
    _, mid = new_run(svc, "alice")
    failpoints.arm("checkpoint.after_write", "raise")
    try:
        state = svc.retrieve("alice", svc.save_weights_external("alice", mid, 1, "ex").request_id, 60)
    finally:
        failpoints.disarm()
    assert state.status == "failed" and "fail point" in state.error
    data = svc.config.data_dir
    assert list(data.glob("checkpoints/*/external_weights/ex.*"))  # the complete but uncommitted directory
    svc.close()
    svc = make_service()  # same data directory: the start-up sweep removes what no row names
    assert not list(data.glob("checkpoints/*/external_weights/*"))
    assert svc.list_checkpoints("alice", mid).checkpoints == []


def test_tokens_expire_and_bind_their_fields(tmp_path):
    secret = load_secret(tmp_path)
    assert load_secret(tmp_path) == secret and oct((tmp_path / "external_weights.key").stat().st_mode)[-3:] == "600"
    signer = LinkSigner(secret)
    token, expires = signer.sign("tinker://r/external_weights/x", "alice", "/d")
    path, exp, mac = signer.tinker_path_of(token)
    signer.check(path, "alice", "/d", exp, mac)
    for owner, directory in [("bob", "/d"), ("alice", "/other")]:
        with pytest.raises(NotFoundError, match=REFUSED):
            signer.check(path, owner, directory, exp, mac)
    with pytest.raises(NotFoundError, match=REFUSED):
        LinkSigner(b"x" * 32).check(path, "alice", "/d", exp, mac)
    stale, _ = signer.sign("tinker://r/external_weights/x", "alice", "/d", ttl_s=-1)
    for bad in [stale, "", "a.b", "1.!!.c", token + ".x", None]:
        with pytest.raises(NotFoundError, match=REFUSED):
            signer.tinker_path_of(bad)
    assert abs(expires - (time.time() + 3600)) < 5


def test_only_regular_files_of_the_export_are_served(tmp_path):
    export = tmp_path / "export"
    (export / "sub").mkdir(parents=True)
    (export / "a.json").write_text("{}")
    (export / "sub" / "b.bin").write_bytes(b"x")
    (export / ".hidden").write_text("no")
    (tmp_path / "secret").write_text("no")
    os.symlink(tmp_path / "secret", export / "link")
    os.symlink(tmp_path, export / "dirlink", target_is_directory=True)
    assert export_files(export) == ["a.json", "sub/b.bin"]
    assert resolve_file(export, "sub/b.bin") == (export / "sub" / "b.bin").resolve()
    for bad in ["link", "dirlink/secret", ".hidden", "../secret", "sub/../a.json", "/etc/passwd", "", None, "sub"]:
        with pytest.raises(NotFoundError, match=REFUSED):
            resolve_file(export, bad)


def test_exports_work_with_engines_on_a_worker_group(tmp_path, tiny_model_dir):
    from ember.service import Service, ServiceConfig
    from ember.service.engines import WorkerGroupEngineFactory
    from ember.workers import WorkerGroup

    group = WorkerGroup.create("inline", world_size=1)
    try:
        cfg = ServiceConfig(data_dir=tmp_path / "wg", models={"tiny": str(tiny_model_dir)})
        with Service(cfg, engine_factory=WorkerGroupEngineFactory(group)) as svc:
            _, mid = new_run(svc, "alice")
            path = _export(svc, mid, 1).path
            files = svc.external_weights_links("alice", mid, "external_weights/ex").files
            assert path.endswith("/external_weights/ex") and "adapter_model.safetensors" in files
    finally:
        group.shutdown()
