"""Datasets: the standard layouts on tiny fixtures, transforms, the emoji loader, bad input."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from pipelines.config import ConfigError, DataConfig
from pipelines.data import (
    DATASETS,
    FILE_DATASETS,
    DataError,
    build_datasets,
    dataset_labels,
    default_root,
    with_absolute_root,
)
from pipelines.data import emoji as emoji_loader
from pipelines.data import emoji_build as emoji_mod
from pipelines.data.transforms import eval_transform, train_transform

RNG = np.random.default_rng(0)


def _image(path: Path, size: tuple[int, int] = (20, 16), fmt: str | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(RNG.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).save(path, format=fmt)


def _cfg(name: str, root: Path, **kw) -> DataConfig:
    base = {"batch_size": 4, "samples_per_class": 2, "image_size": 16}
    return DataConfig(name=name, root=str(root), **{**base, **kw})


# -- fixtures in each benchmark's own layout ----------------------------------------------------
def make_cub(root: Path, classes: int = 4, per_class: int = 3) -> None:
    images, labels, names = [], [], []
    n = 0
    for c in range(1, classes + 1):
        folder = f"{c:03d}.Bird_{c}"
        names.append(f"{c} {folder}")
        for i in range(per_class):
            n += 1
            rel = f"{folder}/Bird_{c}_{i}.jpg"
            _image(root / "images" / rel, fmt="JPEG")
            images.append(f"{n} {rel}")
            labels.append(f"{n} {c}")
    (root / "images.txt").write_text("\n".join(images) + "\n")
    (root / "image_class_labels.txt").write_text("\n".join(labels) + "\n")
    (root / "classes.txt").write_text("\n".join(names) + "\n")


def make_cars(root: Path, classes: int = 4, per_class: int = 3) -> None:
    from scipy.io import savemat

    dtype = [("relative_im_path", object), ("bbox_x1", object), ("bbox_y1", object), ("bbox_x2", object),
             ("bbox_y2", object), ("class", object), ("test", object)]
    rows = []
    n = 0
    for c in range(1, classes + 1):
        for _ in range(per_class):
            n += 1
            rel = f"car_ims/{n:06d}.jpg"
            _image(root / rel, fmt="JPEG")
            rows.append((rel, 1, 1, 10, 10, np.uint8(c), np.uint8(n % 2)))
    ann = np.array(rows, dtype=dtype).reshape(1, -1)  # MATLAB's 1 x N struct array
    savemat(root / "cars_annos.mat", {"annotations": ann, "class_names": np.array([f"car {c}" for c in
                                                                                    range(classes)], dtype=object)})


def make_sop(root: Path) -> None:
    for file, classes in (("Ebay_train.txt", (1, 2, 3)), ("Ebay_test.txt", (4, 5))):
        lines = ["image_id class_id super_class_id path"]
        n = 0
        for c in classes:
            for i in range(2):
                n += 1
                rel = f"bicycle_final/{c}_{i}.JPG"
                _image(root / rel, fmt="JPEG")
                lines.append(f"{n} {c} 1 {rel}")
        (root / file).write_text("\n".join(lines) + "\n")


def make_inshop(root: Path) -> None:
    rows = []
    for item, status in (("id_01", "train"), ("id_02", "train"), ("id_03", "train")):
        for i in range(2):
            rows.append((f"img/WOMEN/Dresses/{item}/0{i}_front.jpg", item, status))
    for item in ("id_04", "id_05"):
        rows.append((f"img/MEN/Tees/{item}/01_front.jpg", item, "query"))
        for i in range(2):
            rows.append((f"img/MEN/Tees/{item}/0{i + 2}_side.jpg", item, "gallery"))
    for rel, _, _ in rows:
        _image(root / rel, fmt="JPEG")
    text = [str(len(rows)), "image_name item_id evaluation_status"] + [f"{r}  {i}  {s}" for r, i, s in rows]
    (root / "list_eval_partition.txt").write_text("\n".join(text) + "\n")


def make_emoji(root: Path, classes: int = 6, designs: tuple[str, ...] = ("google", "openmoji_color",
                                                                          "openmoji_black")) -> None:
    """A built emoji folder without npm: same manifest as build_emoji writes."""
    rows = []
    for c in range(classes):
        key = f"1F6{c:02d}"
        split = "train" if c < classes // 2 else "test"
        for d in designs:
            rel = f"{split}/{key}/{d}.png"
            _image(root / rel, size=(32, 32), fmt="PNG")
            rows.append({"key": key, "name": f"e{c}", "category": "Objects", "design": d,
                         "family": emoji_mod.DESIGNS[d].family, "split": split, "file": rel,
                         "sha256": "", "source_sha256": ""})
    emoji_mod._write_csv(root / "manifest.csv", rows, list(emoji_mod.MANIFEST_FIELDS), stamp="1:32")
    (root / "summary.json").write_text(json.dumps({"size": 32}))


# -- the loaders ---------------------------------------------------------------------------------------
def test_every_dataset_is_registered():
    assert {"digits", "folder", "emoji", "cub", "cars", "sop", "inshop"} <= set(DATASETS)


def test_digits_are_scikit_learns_digits_read_without_importing_it():
    from sklearn.datasets import load_digits

    bunch = load_digits()
    split = build_datasets(DataConfig(name="digits", image_size=8))
    images = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(bunch.target)
    assert torch.equal(split.train.images, images[labels < 5]) and torch.equal(split.test.images, images[labels >= 5])
    assert torch.equal(split.train.labels, labels[labels < 5]) and torch.equal(split.test.labels, labels[labels >= 5])
    assert split.num_classes == 5 and len(split.train) == 901 and len(split.test) == 896


def test_cub_layout_splits_first_half_of_classes(tmp_path):
    make_cub(tmp_path / "CUB_200_2011")
    split = build_datasets(_cfg("cub", tmp_path))  # the parent folder also works
    assert (len(split.train), len(split.test), split.num_classes) == (6, 6, 2)
    assert split.train.classes == ["1", "2"] and split.test.classes == ["3", "4"]
    image, label, index = split.train[4]
    assert image.shape == (3, 16, 16) and label == 1 and index == 4
    assert 0.0 <= image.min() and image.max() <= 1.0


def test_cars_layout_reads_a_real_mat_file(tmp_path):
    make_cars(tmp_path, classes=4, per_class=3)
    split = build_datasets(_cfg("cars", tmp_path))
    assert (len(split.train), len(split.test), split.num_classes) == (6, 6, 2)
    assert sorted(set(dataset_labels(split.test))) == [0, 1]
    assert split.test.samples[0][0].name == "000007.jpg"
    assert split.test[0][0].shape == (3, 16, 16)


def test_sop_layout_uses_its_own_split_files(tmp_path):
    make_sop(tmp_path)
    split = build_datasets(_cfg("sop", tmp_path))
    assert (len(split.train), len(split.test), split.num_classes) == (6, 4, 3)
    assert split.test.classes == ["4", "5"]


def test_inshop_layout_fills_query_and_gallery(tmp_path):
    make_inshop(tmp_path)
    split = build_datasets(_cfg("inshop", tmp_path))
    assert (len(split.train), split.num_classes) == (6, 3)
    assert split.query_indices == [0, 1] and split.gallery_indices == [2, 3, 4, 5]
    labels = dataset_labels(split.test)
    # Queries and gallery share one label space: each query's item is in the gallery.
    assert {labels[i] for i in split.query_indices} == {labels[i] for i in split.gallery_indices}


def test_generic_folder_uses_recipe_transforms(tmp_path):
    for part, classes in (("train", "ab"), ("test", "cd")):
        for c in classes:
            for i in range(2):
                _image(tmp_path / part / c / f"{i}.png", size=(40, 30))
    split = build_datasets(_cfg("folder", tmp_path, image_size=24))
    assert split.train[0][0].shape == (3, 24, 24) and split.test[0][0].shape == (3, 24, 24)


def test_emoji_loader_exposes_design_families_as_groups(tmp_path):
    make_emoji(tmp_path)
    split = build_datasets(_cfg("emoji", tmp_path, image_size=0, random_flip=False))
    assert (len(split.train), len(split.test), split.num_classes) == (9, 9, 3)
    assert split.test[0][0].shape == (3, 32, 32)  # image_size 0 = the built size
    # google is its own family; OpenMoji colour and black are one.
    assert split.test_groups is not None and len(split.test_groups) == 9
    designs = [p.stem for p, _ in split.test.samples]
    fam = dict(zip(designs, split.test_groups))
    assert fam["openmoji_color"] == fam["openmoji_black"] != fam["google"]


def test_loader_workers_decode_in_worker_processes(tmp_path):
    make_emoji(tmp_path)
    split = build_datasets(_cfg("emoji", tmp_path))
    batches = list(DataLoader(split.test, batch_size=4, num_workers=2))
    assert sum(len(b[1]) for b in batches) == 9


# -- transforms --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("size", [224, 227, 256])
def test_crop_size_is_configurable(size):
    image = Image.fromarray(RNG.integers(0, 255, (300, 400, 3), dtype=np.uint8))
    cfg = DataConfig(image_size=size)
    assert train_transform(cfg, size)(image).shape == (3, size, size)
    assert eval_transform(cfg, size)(image).shape == (3, size, size)


def test_eval_scale_enlarges_evaluation_only(tmp_path):
    # FixRes: train crops at image_size, evaluate at eval_scale x that; digits and files alike.
    image = Image.fromarray(RNG.integers(0, 255, (300, 400, 3), dtype=np.uint8))
    cfg = DataConfig(image_size=128, eval_resize=128, eval_scale=1.25)
    assert train_transform(cfg, 128)(image).shape == (3, 128, 128)
    # eval_resize scales too: a recipe's "resize to 128, crop 128" (no crop) stays a no-crop at 160
    assert torch.equal(eval_transform(cfg, 128)(image), eval_transform(DataConfig(eval_resize=160), 160)(image))
    # without eval_resize the resize is 8/7 of the scaled crop: a 183 px short side for a 160 crop
    assert torch.equal(eval_transform(DataConfig(eval_scale=1.25), 128)(image),
                       eval_transform(DataConfig(eval_resize=183), 160)(image))
    make_cub(tmp_path)
    split = build_datasets(_cfg("cub", tmp_path, image_size=16, eval_scale=1.5))
    assert split.train[0][0].shape == (3, 16, 16) and split.test[0][0].shape == (3, 24, 24)
    digits = build_datasets(DataConfig(name="digits", image_size=16, eval_scale=1.25))
    assert digits.train[0][0].shape == (1, 16, 16) and digits.test[0][0].shape == (1, 20, 20)
    assert build_datasets(DataConfig(name="digits", eval_scale=2.0)).test[0][0].shape == (1, 16, 16)
    for bad in (0.0, -1.0, 5.0):
        with pytest.raises(ConfigError, match="data.eval_scale must be in"):
            DataConfig(eval_scale=bad)


def test_val_classes_hold_out_seen_classes_with_the_eval_transform(tmp_path):
    # Emoji: 8 seen classes x 3 designs; hold out 3 of them.
    make_emoji(tmp_path, classes=16)
    full = build_datasets(_cfg("emoji", tmp_path, image_size=16, eval_scale=1.5, random_flip=False))
    split = build_datasets(_cfg("emoji", tmp_path, image_size=16, eval_scale=1.5, random_flip=False, val_classes=3))
    assert (split.num_classes, len(split.train), len(split.test)) == (5, 15, 9)
    train_keys = {split.train.classes[y] for y in dataset_labels(split.train)}
    val_files = {p for p, _ in split.test.samples}
    val_keys = {p.parent.name for p in val_files}
    assert len(train_keys) == 5 and len(val_keys) == 3 and not train_keys & val_keys
    # Only seen classes are used: the unseen half is never read.
    assert (train_keys | val_keys) == set(full.train.classes)
    assert val_files <= {p for p, _ in full.train.samples}
    assert sorted(set(dataset_labels(split.train))) == [0, 1, 2, 3, 4]
    # Training keeps its random crops; the held-out images are scored like the test set (24 px).
    assert split.train[0][0].shape == (3, 16, 16) and split.test[0][0].shape == (3, 24, 24)
    # Design families travel with the held-out images (the cross-family report still works).
    fam = dict(zip((p.stem for p, _ in split.test.samples), split.test_groups))
    assert fam["openmoji_color"] == fam["openmoji_black"] != fam["google"]
    # One fixed draw: the same classes however often it is built (train.seed plays no part).
    again = build_datasets(_cfg("emoji", tmp_path, image_size=16, random_flip=False, val_classes=3))
    assert {p for p, _ in again.test.samples} == val_files
    # A plain image folder (torchvision's ImageFolder underneath) holds out the same way.
    for part, classes in (("train", "abcd"), ("test", "ef")):
        for c in classes:
            for i in range(2):
                _image(tmp_path / "folder" / part / c / f"{i}.png", size=(40, 30))
    folder = build_datasets(_cfg("folder", tmp_path / "folder", image_size=24, val_classes=2))
    assert folder.num_classes == 2 and len(folder.train) == len(folder.test) == 4
    assert {p.parent.parent.name for p, _ in folder.test.samples} == {"train"}
    assert folder.test[0][0].shape == (3, 24, 24)
    # In-memory digits: 5 seen digits, 2 held out, images resized to the evaluation size.
    digits = build_datasets(DataConfig(name="digits", image_size=16, eval_scale=1.25, val_classes=2))
    assert digits.num_classes == 3 and set(dataset_labels(digits.train)) == {0, 1, 2}
    held = set(dataset_labels(digits.test))
    assert len(held) == 2 and held <= {0, 1, 2, 3, 4} and digits.test[0][0].shape == (1, 20, 20)
    # Too many or too few held-out classes, or a negative count: one message naming the key.
    for n in (1, 4):
        with pytest.raises(DataError, match=f"data.val_classes={n}: dataset 'digits' has 5 seen classes; "
                                            "hold out between 2 and 3"):
            build_datasets(DataConfig(name="digits", val_classes=n))
    with pytest.raises(ConfigError, match="data.val_classes"):
        DataConfig(val_classes=-1)


def test_flip_switch_and_deterministic_eval():
    # A left/right asymmetric image: with flips off and no crop, training never mirrors it.
    array = np.zeros((16, 16, 3), dtype=np.uint8)
    array[:, :8] = 255
    image = Image.fromarray(array)
    no_flip = train_transform(DataConfig(random_flip=False, crop_scale_min=1.0), 16)
    torch.manual_seed(0)
    assert all(no_flip(image)[0, 0, 0] == 1.0 for _ in range(20))
    flip = train_transform(DataConfig(random_flip=True, crop_scale_min=1.0), 16)
    assert any(flip(image)[0, 0, 0] == 0.0 for _ in range(40))
    ev = eval_transform(DataConfig(eval_resize=16), 16)
    assert torch.equal(ev(image), ev(image))


def test_config_checks_the_new_data_keys():
    with pytest.raises(ConfigError, match="data.crop_scale_min"):
        DataConfig(crop_scale_min=0.0)
    with pytest.raises(ConfigError, match="data.eval_resize"):
        DataConfig(image_size=224, eval_resize=200)


# -- bad input -----------------------------------------------------------------------------------------------
def test_corrupt_image_names_the_file(tmp_path):
    make_cub(tmp_path)
    bad = tmp_path / "images" / "001.Bird_1" / "Bird_1_0.jpg"
    bad.write_bytes(b"not a jpeg at all")
    split = build_datasets(_cfg("cub", tmp_path))
    with pytest.raises(DataError, match="cannot decode image .*Bird_1_0.jpg"):
        split.train[0]
    # Through DataLoader workers the same error type and file name come back.
    with pytest.raises(DataError, match="Bird_1_0.jpg"):
        list(DataLoader(split.train, batch_size=2, num_workers=1))


def test_missing_split_file_is_named(tmp_path):
    make_sop(tmp_path)
    (tmp_path / "Ebay_test.txt").unlink()
    with pytest.raises(DataError, match=r"split file .*Ebay_test.txt is missing"):
        build_datasets(_cfg("sop", tmp_path))
    make_cub(tmp_path / "cub")
    (tmp_path / "cub" / "image_class_labels.txt").unlink()
    with pytest.raises(DataError, match="image_class_labels.txt is missing"):
        build_datasets(_cfg("cub", tmp_path / "cub"))


def test_missing_listed_image_is_counted_not_skipped(tmp_path):
    make_cub(tmp_path)
    (tmp_path / "images" / "002.Bird_2" / "Bird_2_1.jpg").unlink()
    with pytest.raises(DataError, match=r"1 of 6 listed image\(s\) are missing, e.g. .*Bird_2_1.jpg"):
        build_datasets(_cfg("cub", tmp_path))


def test_class_with_one_image_is_refused_or_counted(tmp_path, capsys):
    make_cub(tmp_path)
    lines = (tmp_path / "image_class_labels.txt").read_text().splitlines()
    # Images 2 and 3 of class 1 become class 2: class 1 keeps a single image.
    lines[1], lines[2] = "2 2", "3 2"
    (tmp_path / "image_class_labels.txt").write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"1 training class\(es\) have a single image .*samples_per_class=2"):
        build_datasets(_cfg("cub", tmp_path))
    split = build_datasets(_cfg("cub", tmp_path, samples_per_class=0))
    assert len(split.train) == 6  # kept, not skipped
    assert "1 training class(es) have a single image (kept)" in capsys.readouterr().out


def test_unknown_dataset_name_is_refused_by_the_config():
    # Checked against the loaders' registry when the config is built, before any data is read.
    with pytest.raises(ConfigError, match=r"data.name must be one of digits, folder, emoji, .*; got 'imagenet'"):
        DataConfig(name="imagenet")


def test_every_file_dataset_defaults_to_data_name_and_is_made_absolute(tmp_path, monkeypatch):
    # One rule for every loader (and `data build emoji`'s default --out): ./data/<data.name>,
    # resolved against the folder proxydml runs in before the config reaches Ray workers.
    monkeypatch.chdir(tmp_path)
    assert set(FILE_DATASETS) == set(DATASETS) - {"digits"}
    assert emoji_mod.DEFAULT_ROOT == "data/emoji"
    for name in FILE_DATASETS:
        if name == "folder":  # needs an explicit root; its loader says so
            continue
        assert default_root(DataConfig(name=name)) == Path("data") / name
        assert with_absolute_root(DataConfig(name=name)).root == str(tmp_path / "data" / name)
        with pytest.raises(DataError, match=f"{tmp_path / 'data' / name}"):
            build_datasets(with_absolute_root(DataConfig(name=name)))
    assert with_absolute_root(DataConfig(name="cub", root="s3://bucket/cub")).root == "s3://bucket/cub"
    assert with_absolute_root(DataConfig(name="digits")).root == ""


def test_unreadable_or_missing_folder(tmp_path):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("x")
    for name in ("cub", "cars", "sop", "inshop"):
        with pytest.raises(DataError, match=f"{name}: .*file does not exist or is not a folder"):
            build_datasets(_cfg(name, not_a_folder))
    with pytest.raises(DataError, match="emoji data set folder .*nowhere does not exist.*proxydml data build emoji"):
        build_datasets(_cfg("emoji", tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="manifest.csv is missing"):
        build_datasets(_cfg("emoji", tmp_path / "empty"))
    with pytest.raises(DataError, match="image folder .*train does not exist"):
        build_datasets(_cfg("folder", tmp_path / "empty"))


def test_malformed_split_lines_and_mat_file(tmp_path):
    make_inshop(tmp_path)
    path = tmp_path / "list_eval_partition.txt"
    path.write_text(path.read_text() + "img/x.jpg id_09 validation\n")
    with pytest.raises(DataError, match="unknown evaluation_status"):
        build_datasets(_cfg("inshop", tmp_path))
    cars = tmp_path / "cars"
    cars.mkdir()
    (cars / "cars_annos.mat").write_bytes(b"garbage")
    with pytest.raises(DataError, match="cannot read .*cars_annos.mat"):
        build_datasets(_cfg("cars", cars))


# -- emoji build pieces that need no network ---------------------------------------------------------------------
def test_emoji_keys_drop_fe0f_and_upper_case():
    assert emoji_mod.emoji_key("2764-fe0f-200d-1f525") == "2764-200D-1F525"
    assert emoji_mod.emoji_key("1f600") == "1F600"


def test_class_order_is_seeded_and_not_unicode_order():
    keys = [f"1F{i:03X}" for i in range(200)]
    a, b = emoji_mod.class_order(keys, 0), emoji_mod.class_order(keys, 0)
    assert a == b and a != sorted(keys) and emoji_mod.class_order(keys, 1) != a


def test_iconify_alias_flip_is_applied():
    icons = {"width": 32, "height": 32, "icons": {"left-hand": {"body": "<path d='M0 0h8v8z'/>"}},
             "aliases": {"right-hand": {"parent": "left-hand", "hFlip": True}}}
    svg = emoji_mod._iconify_svg(icons, "right-hand").decode()
    assert 'transform="translate(32 0) scale(-1 1)"' in svg and 'viewBox="0 0 32 32"' in svg


def test_build_needs_npm(tmp_path, monkeypatch):
    monkeypatch.setattr(emoji_mod.shutil, "which", lambda name: None)
    with pytest.raises(DataError, match="needs npm"):
        emoji_mod.build_emoji(tmp_path / "e", designs=["google", "twitter"], progress=False)


def test_build_rejects_bad_arguments(tmp_path):
    with pytest.raises(DataError, match="unknown emoji design"):
        emoji_mod.build_emoji(tmp_path, designs=["google", "apple"], progress=False)
    with pytest.raises(DataError, match="at least 2 designs"):
        emoji_mod.build_emoji(tmp_path, designs=["google"], progress=False)
    with pytest.raises(DataError, match="size"):
        emoji_mod.build_emoji(tmp_path, size=4, progress=False)


def test_duplicates_are_counted_across_classes():
    rows = [{"key": "A", "design": "g", "sha256": "x"}, {"key": "B", "design": "g", "sha256": "x"},
            {"key": "A", "design": "t", "sha256": "y"}, {"key": "A", "design": "o", "sha256": "y"}]
    dup = emoji_mod._duplicates(rows)
    assert (dup["images"], dup["groups"]) == (2, 1)  # same bytes within one class are not duplicates


def test_manifest_round_trip(tmp_path):
    make_emoji(tmp_path)
    rows = emoji_loader.read_manifest(tmp_path)
    assert len(rows) == 18 and set(rows[0]) == set(emoji_mod.MANIFEST_FIELDS)
    with (tmp_path / "manifest.csv").open() as f:
        assert f.readline().startswith("# stamp=")
        assert next(csv.reader(f))[0] == "key"


def test_cli_data_build_reports_user_errors(tmp_path, capsys, monkeypatch):
    from services.cli import main

    assert main(["data", "build", "emoji", "--designs", "google", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == "error: the emoji data set needs at least 2 designs (one image per design and class)"
    monkeypatch.setattr(emoji_mod.shutil, "which", lambda name: None)
    assert main(["data", "build", "emoji", "--tiny", "--quiet", "--out", str(tmp_path / "e")]) == 2
    assert "needs npm" in capsys.readouterr().err
