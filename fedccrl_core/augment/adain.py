"""AdaIN style transfer (Huang & Belongie, ICCV 2017) as CCST uses it (ccst.txt Sec. 3, Eq. 1-8).

    Eq. 1   F_c = Phi(I_c), F_s = Phi(I_s)          Phi: VGG-19 encoder up to relu4_1 (512 channels)
    Eq. 2   AdaIN(F_c, F_s) = sigma(F_s) (F_c - mu(F_c)) / sigma(F_c) + mu(F_s)
    Eq. 4   S = SE(I_s) = (S_mu, S_sigma) = (mu(Phi(I_s)), sigma(Phi(I_s)))     style = statistics only
    Eq. 5   I_{c<-s} = G(I_c, S) = Psi(S_sigma (Phi(I_c) - mu(Phi(I_c))) / sigma(Phi(I_c)) + S_mu)
    Eq. 6   single image style  S_single(i) = (mu(F_i), sigma(F_i))
    Eq. 8   overall domain style S_overall = (mu(F_all), sigma(F_all)), F_all = Stack(F_1..F_M)

mu and sigma are channel-wise over the spatial positions (Eq. 2: "x x 1" for features "x x h x w").
sigma is the population std with eps = 1e-5 added to the variance, as the CCST/AdaIN reference
code does (the reference's AdaIN uses the unbiased variance for the CONTENT features and the
population one for the style; we use the population variance for both, so that AdaIN's output
has exactly the style's statistics; at 28 x 28 relu4_1 positions the two differ by 0.06 %).
Eq. 8 stacks the features of ALL M images and takes the statistics over every pixel of every
image: mu_all is the mean of the per-image means, but sigma_all^2 = mean_i(sigma_i^2 + mu_i^2)
- mu_all^2 (law of total variance), NOT the mean of the per-image sigmas. We accumulate
sum(F) and sum(F^2) per channel in float64, as the reference `mean_std_computation_effcientMem.py`
does (in float32 there).

Networks. Phi and Psi are the layer layout of the AdaIN release (pytorch-AdaIN `net.py`, the
models CCST's reference code loads): Phi = `vgg_normalised` truncated after relu4_1 (its first 31
modules): a 1x1 conv that maps [0, 1] RGB to the Caffe VGG input, then VGG-19's 3x3 convs with
REFLECTION padding. torchvision's vgg19 has no 1x1 conv, zero padding and unnormalized
activations, and the pretrained decoder only inverts its own encoder, so Phi is written here
rather than taken from torchvision. Psi mirrors Phi with nearest upsampling and reflection
padding. Both take and give images in [0, 1] RGB (no ImageNet normalization). Both are frozen
and live outside the federated model: never trained, aggregated or exported.

Weights (`load_adain_networks`): `weights` is
  - a path or http(s)/file URL of ONE torch file {"vgg": state_dict, "decoder": state_dict}
    (what `save_adain_weights` writes), with `sha256` its 64-hex sha256; or
  - a mapping {"vgg": path|url, "decoder": path|url} (e.g. the two files of the pytorch-AdaIN
    release, `vgg_normalised.pth` and `decoder.pth`), with `sha256` a mapping of the same keys;
  - "random": seeded random weights (Kaiming normal) for TESTS ONLY, with a loud warning.
The sha256 is required and verified before `torch.load` (weights_only). A URL is downloaded once
into a content-addressed cache ($FEDCCRL_CACHE or ~/.cache/fedccrl, /adain/<sha256>.pth). Every
failure raises AdaINWeightsError naming the param at fault; nothing ever falls back to random.


Floor 1 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from fedccrl_core.data.checksums import sha256_file
from fedccrl_core.foundation.errors import FedCCRLError
from fedccrl_core.foundation.fsio import atomic_file, atomic_path

EPS = 1e-5  # added to the variance (AdaIN / CCST reference `calc_mean_std`)
RELU4_1 = 31  # modules of vgg_normalised up to and including relu4_1
RANDOM_WEIGHTS_SEED = 0
DOWNLOAD_RETRIES = 3
NET_KEYS = ("vgg", "decoder")


class AdaINWeightsError(FedCCRLError):
    """The AdaIN weights cannot be found, fetched, verified or loaded (names the param)."""


class RandomAdaINWeightsWarning(UserWarning):
    """The AdaIN networks run with random weights (tests only)."""


# ---------------------------------------------------------------------------------------------
# Phi and Psi
# ---------------------------------------------------------------------------------------------
def _conv(c_in: int, c_out: int) -> list[nn.Module]:
    return [nn.ReflectionPad2d(1), nn.Conv2d(c_in, c_out, 3), nn.ReLU()]


def build_encoder() -> nn.Sequential:
    """Phi: vgg_normalised up to relu4_1; module indices match the release's state_dict keys."""
    pool = lambda: nn.MaxPool2d(2, 2, ceil_mode=True)  # noqa: E731
    layers: list[nn.Module] = [nn.Conv2d(3, 3, 1)]
    layers += _conv(3, 64) + _conv(64, 64) + [pool()]  # relu1_1, relu1_2
    layers += _conv(64, 128) + _conv(128, 128) + [pool()]  # relu2_1, relu2_2
    layers += _conv(128, 256) + _conv(256, 256) + _conv(256, 256) + _conv(256, 256) + [pool()]  # relu3_1-3_4
    layers += _conv(256, 512)  # relu4_1
    assert len(layers) == RELU4_1
    return nn.Sequential(*layers)


def build_decoder() -> nn.Sequential:
    """Psi: the mirror of Phi (nearest upsampling, reflection padding), no ReLU on the output."""
    up = lambda: nn.Upsample(scale_factor=2, mode="nearest")  # noqa: E731
    layers: list[nn.Module] = [*_conv(512, 256), up()]
    layers += _conv(256, 256) + _conv(256, 256) + _conv(256, 256) + _conv(256, 128) + [up()]
    layers += _conv(128, 128) + _conv(128, 64) + [up()]
    layers += [*_conv(64, 64), nn.ReflectionPad2d(1), nn.Conv2d(64, 3, 3)]
    return nn.Sequential(*layers)


class AdaINNetworks(nn.Module):
    """The frozen encoder Phi and decoder Psi (eval mode, no gradients)."""

    def __init__(self, encoder: nn.Sequential | None = None, decoder: nn.Sequential | None = None):
        super().__init__()
        with torch.random.fork_rng(devices=[]):  # building modules must not move the global RNG
            self.encoder = encoder if encoder is not None else build_encoder()
            self.decoder = decoder if decoder is not None else build_decoder()
        self.requires_grad_(False)
        self.eval()

    def train(self, mode: bool = True):  # always frozen
        return super().train(False)


# ---------------------------------------------------------------------------------------------
# Eq. 2, 4-8
# ---------------------------------------------------------------------------------------------
def feature_stats(feat: torch.Tensor, eps: float = EPS) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 6: channel-wise (mu, sigma) of features [B, C, H, W] -> ([B, C], [B, C])."""
    mu = feat.mean(dim=(2, 3))
    var = feat.var(dim=(2, 3), unbiased=False)
    return mu, (var + eps).sqrt()


def adain(f_c: torch.Tensor, mu_s: torch.Tensor, sigma_s: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """Eq. 2 / Eq. 5 with the style given as statistics S = (mu_s, sigma_s), each [B, C]."""
    mu_c, sigma_c = feature_stats(f_c, eps)
    f_norm = (f_c - mu_c[..., None, None]) / sigma_c[..., None, None]
    return sigma_s[..., None, None] * f_norm + mu_s[..., None, None]


def images01(x_u8: torch.Tensor) -> torch.Tensor:
    """uint8 NCHW -> float [0, 1], Phi's input."""
    return x_u8.float().div_(255.0)


@torch.inference_mode()
def single_image_styles(
    nets: AdaINNetworks, images_u8: torch.Tensor, batch_size: int = 32, eps: float = EPS
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 6-7: S_single(i) for every given image -> (mu [J, 512], sigma [J, 512])."""
    mus, sigmas = [], []
    for s in range(0, images_u8.shape[0], batch_size):
        mu, sigma = feature_stats(nets.encoder(images01(images_u8[s : s + batch_size])), eps)
        mus.append(mu)
        sigmas.append(sigma)
    return torch.cat(mus), torch.cat(sigmas)


@torch.inference_mode()
def overall_style(
    nets: AdaINNetworks, images_u8: torch.Tensor, batch_size: int = 32, eps: float = EPS
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 8: statistics of Stack(F_1..F_M) over every pixel of every image -> ([1, 512], [1, 512])."""
    total = total_sq = None
    count = 0
    for s in range(0, images_u8.shape[0], batch_size):
        f = nets.encoder(images01(images_u8[s : s + batch_size])).double()
        part, part_sq = f.sum(dim=(0, 2, 3)), f.square().sum(dim=(0, 2, 3))
        total = part if total is None else total + part
        total_sq = part_sq if total_sq is None else total_sq + part_sq
        count += f.shape[0] * f.shape[2] * f.shape[3]
    if total is None or total_sq is None:
        raise ValueError("overall_style: no images")
    mu = total / count
    var = (total_sq / count - mu.square()).clamp_min(0.0)
    return mu.float()[None], (var + eps).sqrt().float()[None]


@torch.inference_mode()
def stylize(
    nets: AdaINNetworks,
    f_c: torch.Tensor,
    mu_s: torch.Tensor,
    sigma_s: torch.Tensor,
    size: tuple[int, int],
    eps: float = EPS,
) -> torch.Tensor:
    """Eq. 5: I_{c<-s} = Psi(AdaIN(Phi(I_c), S)) from content features f_c = Phi(I_c); clamped to
    [0, 1]. When the image side is not a multiple of 8 the decoder's output is resized back."""
    out = nets.decoder(adain(f_c, mu_s, sigma_s, eps))
    if tuple(out.shape[-2:]) != tuple(size):
        out = F.interpolate(out, size=size, mode="bilinear", align_corners=False)
    return out.clamp_(0.0, 1.0)


def to_u8(x01: torch.Tensor) -> torch.Tensor:
    return x01.mul(255.0).round_().to(torch.uint8)


# ---------------------------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------------------------
def save_adain_weights(nets: AdaINNetworks, path: str | os.PathLike) -> str:
    """Write {"vgg", "decoder"} state dicts as one file; returns its sha256 (to pin in params)."""
    with atomic_file(path, "wb") as f:
        torch.save({"vgg": nets.encoder.state_dict(), "decoder": nets.decoder.state_dict()}, f)
    return sha256_file(path)


def random_adain_networks(seed: int = RANDOM_WEIGHTS_SEED, param: str = "adain_weights") -> AdaINNetworks:
    """Seeded Kaiming-normal weights (so activations keep their scale through the ReLU stack). TESTS ONLY."""
    msg = (
        f"{param}=random: the AdaIN VGG encoder and decoder have RANDOM weights (seed {seed}); "
        "style transfer produces noise. This is for tests only, never for results."
    )
    print(f"WARNING: {msg}", file=sys.stderr, flush=True)
    warnings.warn(msg, RandomAdaINWeightsWarning, stacklevel=2)
    nets = AdaINNetworks()
    g = torch.Generator().manual_seed(seed)
    for m in nets.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, nonlinearity="relu", generator=g)
            if m.bias is not None:  # every conv of the AdaIN networks has one
                nn.init.zeros_(m.bias)
    return nets


def _is_url(s: str) -> bool:
    return s.startswith(("http://", "https://", "file://"))


def _check_sha(sha, what: str) -> str:
    if not isinstance(sha, str):
        raise AdaINWeightsError(f"{what} is required (64 hex digits, the sha256 of the weights file), got {sha!r}")
    s = sha.strip().lower()
    if len(s) != 64 or any(c not in "0123456789abcdef" for c in s):
        raise AdaINWeightsError(f"{what} must be 64 hex digits, got {sha!r}")
    return s


def cache_dir() -> Path:
    return Path(os.environ.get("FEDCCRL_CACHE") or Path.home() / ".cache" / "fedccrl") / "adain"


def _fetch(source: str, sha256: str, what: str, what_sha: str) -> Path:
    """A local path or a URL -> a local file whose sha256 has been verified."""
    if not _is_url(source):
        path = Path(source).expanduser()
        if not path.is_file():
            raise AdaINWeightsError(f"{what}={source!r}: no such file")
        got = sha256_file(path)
        if got != sha256:
            raise AdaINWeightsError(f"{what_sha}: sha256 mismatch for {path}: expected {sha256}, got {got}")
        return path
    dest = cache_dir() / f"{sha256}.pth"
    if dest.is_file() and sha256_file(dest) == sha256:
        return dest
    from fedccrl_core.data.http import download_url  # lazy: only a URL needs the HTTP machinery

    with atomic_path(dest) as tmp:  # fedccrl_core.foundation.fsio: renamed into the cache only when verified
        try:
            got = download_url(source, tmp, None, retries=DOWNLOAD_RETRIES, progress=True, label=f"AdaIN {what}")
        except (FedCCRLError, OSError) as e:
            raise AdaINWeightsError(f"{what}={source!r}: cannot download ({e})") from e
        if got != sha256:
            raise AdaINWeightsError(f"{what_sha}: sha256 mismatch for {source}: expected {sha256}, got {got}")
    return dest


def _torch_load(path: Path, what: str) -> dict:
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # any unreadable file is the same user error
        raise AdaINWeightsError(f"{what}: {path} is not a readable torch file ({e.__class__.__name__}: {e})") from e
    if not isinstance(obj, Mapping):
        raise AdaINWeightsError(f"{what}: {path} holds a {type(obj).__name__}, not a state_dict")
    return dict(obj)


def _load_into(net: nn.Sequential, state: Mapping, what: str, truncate: int | None = None) -> None:
    state = {
        k: v
        for k, v in state.items()
        if truncate is None or not (k.split(".")[0].isdigit() and int(k.split(".")[0]) >= truncate)
    }
    try:  # the release's vgg_normalised goes on to relu5_4: layers past relu4_1 are dropped above
        net.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise AdaINWeightsError(f"{what}: does not fit the AdaIN layout ({str(e).splitlines()[0]} ...)") from e


def load_adain_networks(weights, sha256, param: str = "train.ccst") -> AdaINNetworks:
    """Build Phi and Psi from `weights` (see the module docstring); errors name `{param}.adain_*`."""
    what, what_sha = f"{param}.adain_weights", f"{param}.adain_sha256"
    if weights is None:
        raise AdaINWeightsError(
            f"{what} is null: CCST needs the pretrained AdaIN VGG encoder and decoder (pytorch-AdaIN's "
            f"vgg_normalised.pth and decoder.pth): set {what} to {{vgg: <path|url>, decoder: <path|url>}} "
            f"(or one combined file) and {what_sha} to their sha256"
        )
    if isinstance(weights, str) and weights == "random":
        return random_adain_networks(param=what)
    nets = AdaINNetworks()
    if isinstance(weights, str):
        path = _fetch(weights, _check_sha(sha256, what_sha), what, what_sha)
        blob = _torch_load(path, what)
        blob.setdefault("vgg", blob.get("encoder"))
        missing = [k for k in NET_KEYS if not isinstance(blob.get(k), Mapping)]
        if missing:
            raise AdaINWeightsError(
                f"{what}: {path} lacks the {missing} state_dict(s) (expected {{'vgg': ..., 'decoder': ...}})"
            )
        states = {k: blob[k] for k in NET_KEYS}
    elif isinstance(weights, Mapping):
        if set(weights) != set(NET_KEYS):
            raise AdaINWeightsError(f"{what} must have exactly the keys {list(NET_KEYS)}, got {sorted(weights)}")
        if not isinstance(sha256, Mapping) or set(sha256) != set(NET_KEYS):
            raise AdaINWeightsError(
                f"{what_sha} must map {list(NET_KEYS)} to sha256 values (as {what} does), got {sha256!r}"
            )
        states = {}
        for k in NET_KEYS:
            path = _fetch(str(weights[k]), _check_sha(sha256[k], f"{what_sha}.{k}"), f"{what}.{k}", f"{what_sha}.{k}")
            states[k] = _torch_load(path, f"{what}.{k}")
    else:
        raise AdaINWeightsError(f"{what} must be null, 'random', a path/URL or {{vgg, decoder}}, got {weights!r}")
    _load_into(nets.encoder, states["vgg"], f"{what} (vgg)", truncate=RELU4_1)
    _load_into(nets.decoder, states["decoder"], f"{what} (decoder)")
    return nets
