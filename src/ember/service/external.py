"""External-weights exports (`save_weights_external`) and their download links.

An export is a checkpoint of kind "external" (`tinker://<run>/external_weights/<name>`),
written like every other checkpoint (fresh directory, fsync, the row as commit point; see
`ember.service.checkpoint_files`) in Hugging Face format by `ember.engine.hf_export`:

* LoRA run: a peft adapter (adapter_config.json, adapter_model.safetensors) + tokenizer files;
* full fine-tuning: config.json, model.safetensors (shards above 5 GiB), generation_config.json
  and tokenizer files;
* a value-head run (critic, reward model): the same, as `<Arch>ForTokenClassification` with
  one label and the head `score` (in the adapter's `modules_to_save` for LoRA).

Download links. The SDK fetches each file with a plain GET and no API key (its CLI uses
urllib), so a link carries its authority: `<expires>.<b64(tinker_path)>.<b64(hmac)>`, the
HMAC (SHA-256, a per-data-directory secret) binding the checkpoint, its owner, the export
directory it names and the expiry. A link stops working when it expires, when the export is
deleted or overwritten, or when the secret file is replaced. Every refusal looks the same
(not found), and only the files the export holds are served (no '..', no links).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import secrets
from pathlib import Path

from ember.engine import hf_export
from ember.engine.base import TrainingEngine
from ember.models.lora import LORA_ALPHA
from ember.service.api import NotFoundError, UserError
from ember.service.clock import SYSTEM_CLOCK, Clock
from ember.service.engines import RunSpec

URL_TTL_S = 3600  # how long a download link works
SECRET_FILE = "external_weights.key"
REFUSED = "unknown or expired external-weights download link"


MERGED_SUFFIX = ".merged"  # an export name ending so asks for LoRA merged into the base model


def write_export(engine: TrainingEngine, spec: RunSpec, name: str, out: Path) -> None:
    """The run's current weights in Hugging Face format, into the (new) directory `out`:
    a peft adapter for a LoRA run, or (name ending in ".merged") the adapter merged into
    the base model's weights; the model itself for full fine-tuning. A value-head run
    exports as `<Arch>ForTokenClassification` (num_labels 1, the head named `score`): the
    full model, or a peft TOKEN_CLS adapter with the head in `modules_to_save`."""
    base_dir = Path(spec.base.directory)
    head = engine.head_weights()
    lora = spec.lora_config
    if lora is None:
        _write_model(out, engine.named_weights(), head, base_dir)
        return
    adapter = dict(engine.named_weights())
    if name.endswith(MERGED_SUFFIX):
        config = json.loads((base_dir / "config.json").read_text())
        merged = hf_export.merge_lora(hf_export.read_base_weights(base_dir), adapter, scale=LORA_ALPHA / lora.rank,
                                      tied_head=bool(config.get("tie_word_embeddings", False)), config=config)
        _write_model(out, merged, head, base_dir)
    else:
        hf_export.write_lora_adapter(out, adapter, rank=lora.rank, alpha=LORA_ALPHA, base_model=spec.base.name,
                                     base_dir=base_dir, head=head or None)


def _write_model(out: Path, weights, head: dict, base_dir: Path) -> None:
    if head:
        hf_export.write_value_model(out, weights, head, base_dir)
    else:
        hf_export.write_full_model(out, weights, base_dir)


def check_export_options(age_encryption_recipients: object) -> None:
    """What an export request may ask for beyond a checkpoint save (whose ttl_seconds is
    checked by `checkpoint_store.check_ttl`, like every save's)."""
    if age_encryption_recipients:
        raise UserError("age_encryption_recipients: ember does not encrypt exports; expected none, got "
                        f"{len(age_encryption_recipients) if isinstance(age_encryption_recipients, list) else 1} "
                        "recipient(s)")


def export_files(directory: Path) -> list[str]:
    """Every regular file under `directory` (links and hidden names are not part of an export)."""
    root = Path(directory)
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if not x.startswith(".") and not (Path(d) / x).is_symlink())
        for f in sorted(files):
            p = Path(d) / f
            if not f.startswith(".") and p.is_file() and not p.is_symlink():
                out.append(p.relative_to(root).as_posix())
    return out


def load_secret(data_dir: Path) -> bytes:
    """The data directory's link-signing secret, created (0600, atomically) on first use."""
    path = Path(data_dir) / SECRET_FILE
    if not path.exists():
        tmp = path.with_name(f".{SECRET_FILE}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, secrets.token_bytes(32).hex().encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)  # never replaces a secret another process wrote meanwhile
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)
    secret = bytes.fromhex(path.read_text().strip())
    if len(secret) < 32:
        raise ValueError(f"{path}: expected a 64-hex-digit secret")
    return secret


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class LinkSigner:
    def __init__(self, secret: bytes, clock: Clock = SYSTEM_CLOCK) -> None:
        self._secret = secret
        self._clock = clock  # the service's (ember.service.clock): links expire by it

    def _mac(self, tinker_path: str, owner: str, directory: str, expires: int) -> bytes:
        msg = "\0".join((tinker_path, owner, directory, str(expires))).encode()
        return hmac.new(self._secret, msg, hashlib.sha256).digest()

    def sign(self, tinker_path: str, owner: str, directory: str, ttl_s: int = URL_TTL_S) -> tuple[str, int]:
        expires = int(self._clock()) + ttl_s
        mac = self._mac(tinker_path, owner, directory, expires)
        return f"{expires}.{_b64(tinker_path.encode())}.{_b64(mac)}", expires

    def tinker_path_of(self, token: object) -> tuple[str, int, bytes]:
        """(tinker_path, expires, mac) of a well-formed, unexpired token; NotFoundError otherwise."""
        try:
            expires_s, path_s, mac_s = str(token).split(".")
            expires, path, mac = int(expires_s), _unb64(path_s).decode(), _unb64(mac_s)
        except (ValueError, UnicodeDecodeError):
            raise NotFoundError(REFUSED) from None
        if expires < self._clock():
            raise NotFoundError(REFUSED)
        return path, expires, mac

    def check(self, tinker_path: str, owner: str, directory: str, expires: int, mac: bytes) -> None:
        if not hmac.compare_digest(mac, self._mac(tinker_path, owner, directory, expires)):
            raise NotFoundError(REFUSED)


def resolve_file(directory: Path, file: object) -> Path:
    """`file` (relative, as `export_files` lists it) inside the export `directory`."""
    if not isinstance(file, str) or file not in export_files(directory):
        raise NotFoundError(REFUSED)
    root = Path(directory).resolve()
    p = (root / file).resolve()
    if root not in p.parents or not p.is_file():
        raise NotFoundError(REFUSED)
    return p
