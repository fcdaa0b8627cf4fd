"""RetinaNet object detection trained from scratch with DistributedDataParallel.

    python examples/retinanet_ddp.py                    # every GPU (about 3 min on 2 H200s)
    python examples/retinanet_ddp.py --gpus 2 --epochs 16
    python examples/retinanet_ddp.py --small            # CPU-sized: 2 gloo processes, ~80 s
    python examples/retinanet_ddp.py --data /data/coco --image-size 800 --epochs 26   # real COCO

torchvision's `retinanet_resnet50_fpn_v2`, randomly initialised (nothing is downloaded), learns
to find red squares, green circles and blue triangles in images that the script draws once into
`--out` as JPEG files with COCO-format annotations (`train2017/`, `val2017/`,
`annotations/instances_{train,val}2017.json`: the layout of a real COCO folder, which `--data`
accepts instead). The images are read back through the COCO loading path: `gpufleet.data`
splits the image files across ranks and loader workers, and a small transform looks up each
file's boxes in the JSON.

Training is the classic recipe: SGD with momentum and the learning rate scaled by the number of
processes (each adds its batch to the global one), linear warmup, StepLR, gradient clipping.
Rank 0 logs the loss. After each epoch every rank detects objects in its share of the held-out
images and rank 0 computes COCO mAP over all of them (torchmetrics with pycocotools or
faster-coco-eval when installed, otherwise the same COCO definition in numpy below, which the
tests check against pycocotools). Every rank returns its losses and the mAP history; the script
checks that the training loss fell and, at the full size, that mAP rose (the few CPU epochs of
`--small` may leave mAP at noise level).
"""

import argparse
import importlib.util
import json
import os
import random
import shutil
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torchvision.io import ImageReadMode, decode_image
from torchvision.models.detection import retinanet_resnet50_fpn_v2
from torchvision.ops import box_iou

from gpufleet import data, distributed, runtime

# -- config ---------------------------------------------------------------------------------
SIZES = {  # generated images, their side in pixels, images per rank per step, epochs
    "full": dict(train_images=3000, val_images=500, image_size=256, batch_size=16, epochs=8),
    "small": dict(train_images=240, val_images=48, image_size=64, batch_size=8, epochs=5),
}
CLASSES = {"red square": (220, 40, 40), "green circle": (40, 200, 60),
           "blue triangle": (40, 70, 230)}  # name: RGB, drawn with some jitter
MIN_SIDE = 24  # px; RetinaNet's smallest anchors are 32 px: much smaller shapes learn slowly
SPLITS = ("train2017", "val2017")  # COCO's folder names; the generated set uses them too
BASE_LR = 0.005  # per process: SGD runs at BASE_LR × world_size (linear scaling rule)
MOMENTUM = 0.9
WEIGHT_DECAY = 1e-4
WARMUP_STEPS = 100  # from scratch, full-rate SGD in the first steps can blow up the loss
MAX_GRAD_NORM = 10.0
LR_DROP_AT = 0.75  # StepLR: divide the learning rate by 10 after this fraction of the epochs
LOG_EVERY = 20  # steps
SEED = 0


# -- the data set: drawn once, then read like any COCO folder --------------------------------
def draw_image(rng: random.Random, size: int):
    """A grey background with 1-3 shapes that do not overlap; boxes as COCO [x, y, w, h]."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (size, size), (rng.randint(60, 190),) * 3)
    draw, objects = ImageDraw.Draw(image), []
    for _ in range(rng.randint(1, 3)):
        for _attempt in range(10):
            side = rng.randint(MIN_SIDE, max(MIN_SIDE, size // 2))
            x, y = rng.randint(0, size - side), rng.randint(0, size - side)
            if all(x + side <= a or a + w <= x or y + side <= b or b + h <= y
                   for _, (a, b, w, h) in objects):
                break
        else:
            continue  # no room left
        label = rng.randrange(len(CLASSES))
        colour = tuple(min(255, max(0, c + rng.randint(-30, 30)))
                       for c in list(CLASSES.values())[label])
        x1, y1 = x + side - 1, y + side - 1
        if label == 0:
            draw.rectangle((x, y, x1, y1), fill=colour)
        elif label == 1:
            draw.ellipse((x, y, x1, y1), fill=colour)
        else:
            draw.polygon([(x + side / 2, y), (x, y1), (x1, y1)], fill=colour)
        objects.append((label + 1, (x, y, side, side)))  # COCO category ids start at 1
    return image, objects


def write_split(root: Path, split: str, count: int, size: int, seed: int) -> None:
    rng = random.Random(seed)
    (root / split).mkdir(parents=True)
    coco = {"images": [], "annotations": [],
            "categories": [{"id": i + 1, "name": name} for i, name in enumerate(CLASSES)]}
    for image_id in range(1, count + 1):
        image, objects = draw_image(rng, size)
        file_name = f"{image_id:06d}.jpg"
        image.save(root / split / file_name, quality=90)
        coco["images"].append({"id": image_id, "file_name": file_name,
                               "width": size, "height": size})
        for category_id, box in objects:
            coco["annotations"].append({"id": len(coco["annotations"]) + 1, "image_id": image_id,
                                        "category_id": category_id, "bbox": list(box),
                                        "area": box[2] * box[3], "iscrowd": 0})
    (root / "annotations").mkdir(exist_ok=True)
    (root / "annotations" / f"instances_{split}.json").write_text(json.dumps(coco))


def make_shapes_dataset(out: Path, train_images: int, val_images: int, size: int) -> Path:
    """Draw the data set once (before any rank starts) and reuse it on later runs. It is
    written to a private temporary folder and renamed into place, so two runs started at
    once never see half a data set: the second rename fails and its copy is dropped."""
    root = out / f"shapes-{size}px-{train_images}-{val_images}"
    if root.exists():
        return root
    print(f"drawing {train_images} + {val_images} images into {root}")
    tmp = out / f".{root.name}.{os.getpid()}.tmp"
    write_split(tmp, SPLITS[0], train_images, size, seed=SEED)
    write_split(tmp, SPLITS[1], val_images, size, seed=SEED + 1)
    try:
        os.rename(tmp, root)
    except OSError:  # another run got there first: its copy is identical
        shutil.rmtree(tmp)
    return root


def coco_paths(root: Path, split: str) -> tuple[Path, Path]:
    return root / split, root / "annotations" / f"instances_{split}.json"


class CocoDetection:
    """file path -> (uint8 image [3, H, W], target): the transform FileDataset applies.

    Labels are the COCO category ids renumbered 0..K-1 (RetinaNet's sigmoid classifier has no
    background class). Crowd regions and degenerate boxes are left out, as torchvision's
    detection references do; mAP on real COCO is then slightly below the official number.
    """

    def __init__(self, annotation_file: Path):
        coco = json.loads(Path(annotation_file).read_text())
        self.categories = sorted(coco["categories"], key=lambda c: c["id"])
        label = {c["id"]: i for i, c in enumerate(self.categories)}
        self.files = [image["file_name"] for image in coco["images"]]
        image_of_id = {image["id"]: image["file_name"] for image in coco["images"]}
        self.boxes, self.labels = defaultdict(list), defaultdict(list)
        for a in coco["annotations"]:
            x, y, w, h = a["bbox"]
            if not a.get("iscrowd") and w > 1 and h > 1:
                self.boxes[image_of_id[a["image_id"]]].append([x, y, x + w, y + h])
                self.labels[image_of_id[a["image_id"]]].append(label[a["category_id"]])

    def __call__(self, path: str):
        name = Path(path).name
        image = decode_image(path, mode=ImageReadMode.RGB)
        boxes = torch.tensor(self.boxes[name], dtype=torch.float32).reshape(-1, 4)
        return image, {"boxes": boxes, "labels": torch.tensor(self.labels[name], dtype=torch.int64)}


def collate(batch):
    return tuple(zip(*batch))  # detection models take lists: images differ in size


def make_loader(root: Path, split: str, batch_size: int, train: bool):
    images, annotations = coco_paths(root, split)
    transform = CocoDetection(annotations)
    # Training pads so every rank runs the same number of steps (DDP's all-reduces must pair
    # up); evaluation reads each held-out image exactly once.
    files = data.FileDataset([str(images / f) for f in transform.files], transform=transform,
                             shuffle=train, seed=SEED, pad=train)
    return files, transform, data.loader(files, batch_size, collate_fn=collate)


# -- evaluation ------------------------------------------------------------------------------
def coco_map(preds: list[dict], targets: list[dict]) -> tuple[float, float]:
    """COCO box mAP@[.5:.95] and mAP@.5 in numpy, for machines without a COCO backend: per
    class, detections (top 100 per image) are matched greedily by score to the best unmatched
    box with IoU >= t, precision is made monotone and read at 101 recall points, and AP is
    averaged over the 10 thresholds and the classes that occur in the targets."""
    thresholds, recall_points = np.linspace(0.5, 0.95, 10), np.linspace(0, 1, 101)
    classes = torch.cat([t["labels"] for t in targets]).unique().tolist()
    ap = np.zeros((len(classes), len(thresholds)))
    for ci, c in enumerate(classes):
        scores, hits, n_boxes = [], [], 0
        for p, t in zip(preds, targets):
            truth = t["boxes"][t["labels"] == c]
            score, order = p["scores"][p["labels"] == c].sort(descending=True, stable=True)
            boxes = p["boxes"][p["labels"] == c][order[:100]]
            iou = box_iou(boxes, truth).numpy()
            free = np.ones((len(thresholds), len(truth)), dtype=bool)
            hit = np.zeros((len(boxes), len(thresholds)), dtype=bool)
            for d in range(len(boxes) if len(truth) else 0):
                candidates = np.where(free & (iou[d] >= thresholds[:, None]), iou[d], -1.0)
                best = candidates.argmax(1)
                hit[d] = candidates[np.arange(len(thresholds)), best] >= 0
                free[hit[d], best[hit[d]]] = False
            scores.append(score[:100].numpy())
            hits.append(hit)
            n_boxes += len(truth)
        order = np.argsort(-np.concatenate(scores), kind="mergesort")
        hit = np.concatenate(hits)[order]
        tp, fp = np.cumsum(hit, axis=0), np.cumsum(~hit, axis=0)
        for ti in range(len(thresholds) if len(hit) else 0):  # no detections: AP 0
            recall = tp[:, ti] / n_boxes
            precision = tp[:, ti] / np.maximum(tp[:, ti] + fp[:, ti], 1e-9)
            precision = np.maximum.accumulate(precision[::-1])[::-1]  # best at this recall or more
            at = np.searchsorted(recall, recall_points, side="left")
            reached = at < len(precision)  # recall points never reached count as precision 0
            ap[ci, ti] = np.where(reached, precision[np.minimum(at, len(precision) - 1)], 0).mean()
    return float(ap.mean()), float(ap[:, 0].mean())


def coco_backend() -> str | None:
    """The COCO evaluator torchmetrics will use, or None when it or both evaluators are missing."""
    if not importlib.util.find_spec("torchmetrics"):
        return None
    return next((name for name in ("faster_coco_eval", "pycocotools")
                 if importlib.util.find_spec(name)), None)


def mean_average_precision(preds: list[dict], targets: list[dict]) -> tuple[float, float]:
    """COCO mAP@[.5:.95] and mAP@.5: torchmetrics when one of its COCO backends is installed."""
    backend = coco_backend()
    if backend is None:
        return coco_map(preds, targets)
    from torchmetrics.detection import MeanAveragePrecision

    # sync_on_compute=False: only rank 0 computes, with every rank's predictions already here.
    metric = MeanAveragePrecision(iou_type="bbox", backend=backend, sync_on_compute=False)
    metric.update(preds, targets)
    result = metric.compute()
    return result["map"].item(), result["map_50"].item()


@torch.no_grad()
def evaluate(model, loader, device) -> tuple[float, float]:
    """Every rank detects objects in its share of the held-out images; rank 0 scores them all."""
    for buffer in model.buffers():  # BatchNorm statistics: each rank updated its own copy in
        dist.broadcast(buffer, src=0)  # the last step; evaluate one model, rank 0's
    model.eval()
    preds, targets = [], []
    for images, batch_targets in loader:
        outputs = model([image.to(device, non_blocking=True).float() / 255 for image in images])
        preds += [{k: v.cpu() for k, v in output.items()} for output in outputs]
        targets += batch_targets
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (preds, targets))
    scores = [None, None]
    if runtime.is_main_process():
        scores = list(mean_average_precision(*(sum((g[i] for g in gathered), []) for i in (0, 1))))
    dist.broadcast_object_list(scores, src=0)  # every rank returns the same history
    model.train()
    return scores[0], scores[1]


# -- training --------------------------------------------------------------------------------
def fit(root: str, out: str, epochs: int, image_size: int,
        batch_size: int) -> tuple[torch.nn.Module, dict]:
    """The training on this rank, inside a `@distributed` function: the trained model (as DDP
    holds it, the same on every rank) and this rank's losses and mAP history. train() below
    returns the history; notebooks/retinanet_ddp.ipynb also logs the model to MLflow."""
    device = runtime.setup()
    torch.set_float32_matmul_precision("high")  # TF32 matmuls on GPUs that have them
    world_size, main = runtime.get_world_size(), runtime.is_main_process()
    torch.manual_seed(SEED)  # the same initial weights everywhere (DDP also broadcasts them)
    train_files, coco, train_loader = make_loader(Path(root), SPLITS[0], batch_size, train=True)
    _, _, val_loader = make_loader(Path(root), SPLITS[1], batch_size, train=False)

    # min_size/max_size: the model's own resize. COCO uses 800/1333; square generated images
    # of side image_size are then left as they are.
    model = retinanet_resnet50_fpn_v2(weights=None, weights_backbone=None,
                                      num_classes=len(coco.categories), min_size=image_size,
                                      max_size=round(image_size * 1333 / 800),
                                      detections_per_img=100)  # COCO mAP counts 100 per image
    model = DDP(model.to(device), device_ids=[device.index] if device.type == "cuda" else None)
    lr = BASE_LR * world_size
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=MOMENTUM,
                                weight_decay=WEIGHT_DECAY)
    # Both schedulers scale the learning rate they find, so they chain: warmup per step,
    # StepLR per epoch.
    lr_drop = torch.optim.lr_scheduler.StepLR(optimizer, max(1, round(epochs * LR_DROP_AT)), 0.1)
    warmup_steps = min(WARMUP_STEPS, len(train_loader) * epochs // 4)
    warmup = torch.optim.lr_scheduler.LinearLR(optimizer, 0.001, 1.0, max(1, warmup_steps))
    if main:
        print(f"{len(train_files.files)} training images, {len(coco.categories)} classes, "
              f"{world_size} processes × {batch_size} images per step, lr {lr:g}; mAP by "
              f"{coco_backend() or 'numpy (pip install pycocotools for the reference code)'}")

    losses, maps, map50s, step, started = [], [], [], 0, time.monotonic()
    for epoch in range(epochs):
        train_files.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        total = torch.zeros(2, device=device)  # sum of losses, number of steps
        for images, targets in train_loader:
            images = [image.to(device, non_blocking=True).float() / 255 for image in images]
            targets = [{k: v.to(device, non_blocking=True) for k, v in t.items()} for t in targets]
            parts = model(images, targets)  # {"classification": focal, "bbox_regression": GIoU}
            loss = sum(parts.values())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # DDP all-reduces the gradients here
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
            optimizer.step()
            step += 1
            if step <= warmup_steps:
                warmup.step()
            total += torch.stack([loss.detach(), torch.ones((), device=device)])
            if step == 1:  # the untrained model's loss, every rank's: what training lowers
                first = loss.detach().clone()
                dist.all_reduce(first)
                first_loss = first.item() / dist.get_world_size()
            if main and step % LOG_EVERY == 0:  # rank 0's own batch: no extra all-reduce
                print(f"epoch {epoch + 1} step {step}  loss {loss.item():.3f} "
                      f"(cls {parts['classification'].item():.3f} "
                      f"box {parts['bbox_regression'].item():.3f})  "
                      f"lr {optimizer.param_groups[0]['lr']:.4f}")
        lr_drop.step()
        dist.all_reduce(total)  # the mean over every rank's steps, for the log line
        losses.append((total[0] / total[1]).item())
        map_, map50 = evaluate(model.module, val_loader, device)
        maps.append(map_)
        map50s.append(map50)
        if main:
            print(f"epoch {epoch + 1}/{epochs}  loss {losses[-1]:.4f}  mAP {map_:.4f}  "
                  f"mAP@.5 {map50:.4f}  ({time.monotonic() - started:.0f} s)")
    if main:
        torch.save(model.module.state_dict(), Path(out) / "retinanet.pt")
    return model.module, {"rank": runtime.get_global_rank(), "first_loss": first_loss, "losses": losses,
                          "map": maps, "map50": map50s}


@distributed
def train(root: str, out: str, epochs: int, image_size: int, batch_size: int) -> dict:
    return fit(root, out, epochs, image_size, batch_size)[1]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=None, help="processes; default: every GPU")
    parser.add_argument("--epochs", type=int, default=None, help="default: by size")
    parser.add_argument("--data", type=Path, default=None,
                        help="a COCO folder (train2017/, val2017/, annotations/) to train on "
                             "instead of the generated shapes")
    parser.add_argument("--out", type=Path, default=Path("retinanet-out"),
                        help="where the generated data set, the weights and metrics.json go")
    parser.add_argument("--image-size", type=int, default=None, help="default: by size")
    parser.add_argument("--small", action="store_true",
                        help="a CPU-sized run: few tiny images, few epochs (the test suite's)")
    args = parser.parse_args()

    size = SIZES["small" if args.small else "full"]
    epochs = args.epochs or size["epochs"]
    image_size = args.image_size or size["image_size"]
    args.out.mkdir(parents=True, exist_ok=True)
    if args.data:
        root = args.data
        missing = [str(p) for split in SPLITS for p in coco_paths(root, split) if not p.exists()]
        if missing:
            parser.error(f"--data {root} is not a COCO folder; missing: {', '.join(missing)}")
    else:
        root = make_shapes_dataset(args.out, size["train_images"], size["val_images"], image_size)

    results = train.options(gpus=args.gpus).distributed(str(root), str(args.out), epochs,
                                                        image_size, size["batch_size"])
    history, losses = results[0]["map"], results[0]["losses"]
    (args.out / "metrics.json").write_text(json.dumps(results, indent=1))
    print(f"mAP by epoch: {' '.join(f'{m:.4f}' for m in history)}")
    first = results[0]["first_loss"]  # a few epochs' means alone may not fall: the first step is what trains away
    assert losses[-1] < first, f"the training loss did not fall: first step {first:.4f}, by epoch {losses}"
    if not args.small:  # a few CPU epochs on 240 tiny images may leave mAP at noise level
        assert history[-1] > history[0], f"mAP did not rise during training: {history}"
