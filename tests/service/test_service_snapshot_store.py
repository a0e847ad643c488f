"""The folders of older snapshot versions (ember.service.snapshot_store): a folder named by
the record on disk is used only when it is an `older-<hex>` subfolder of the run's save."""

from __future__ import annotations

import pytest

from ember.service.snapshot_store import older_dir, older_folder, parse_older


def test_a_folder_of_the_save_is_accepted(tmp_path):
    folder = older_folder("ab12")
    (tmp_path / folder).mkdir()
    assert older_dir(tmp_path, folder) == (tmp_path / folder).resolve()


@pytest.mark.parametrize("folder", ["..", "../older-ab", "/etc", "older-ab/../..", "older-zz", "weights", 3, None,
                                    "older-ab/x"])
def test_a_folder_outside_the_save_or_of_another_name_is_refused(tmp_path, folder):
    (tmp_path / "older-ab").mkdir()
    with pytest.raises(ValueError, match="folder"):
        older_dir(tmp_path, folder)


def test_a_link_that_leaves_the_save_is_refused(tmp_path):
    save, elsewhere = tmp_path / "save", tmp_path / "elsewhere"
    save.mkdir()
    elsewhere.mkdir()
    (save / "older-ab").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(ValueError, match="not a subfolder"):
        older_dir(save, "older-ab")


def test_a_missing_folder_is_refused(tmp_path):
    with pytest.raises(ValueError, match="not a subfolder"):
        older_dir(tmp_path, "older-ab")


def test_weights_tokens_are_hexadecimal():
    with pytest.raises(ValueError, match="hexadecimal"):
        older_folder("../x")


def test_a_malformed_record_entry_is_a_type_error():
    assert parse_older({"s": {"folder": "older-ab", "weights": "ab"}})["s"].folder == "older-ab"
    for bad in ([], {"s": "older-ab"}, {"s": {"folder": 1, "weights": "ab"}}):
        with pytest.raises(TypeError):
            parse_older(bad)
