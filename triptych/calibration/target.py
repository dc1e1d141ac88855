"""What an acceleration must keep: the calibration target and the quality gates (no torch: the CLI
builds it while parsing)."""

from __future__ import annotations

import math
from dataclasses import dataclass

#: Seeds of the fit's trajectories (the sweep's evaluation requests use others).
FIT_SEEDS = (1000, 1001)
#: Thresholds swept by default: dense where 20-50 step schedules meet a 30 dB worst case.
DEFAULT_THRESHOLDS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.07, 0.1, 0.15, 0.2, 0.3)


@dataclass(frozen=True)
class Target:
    """What an acceleration must keep, worst case over the evaluation requests (the issue's default:
    SGLang's calibration bar)."""

    min_psnr: float = 30.0
    """Worst image's PSNR against the plain one, dB."""
    min_ssim: float = 0.92
    """Worst image's SSIM against the plain one."""
    max_adherence_drop: float = 0.02
    """Largest allowed drop of the share of images with every world attribute right (0.02 = 2 points)."""
    min_motion_agreement: float = 1.0
    """Moving shape world: least share of clips that keep the plain clip's direction and shape colour
    (1.0: every clip)."""

    def __post_init__(self) -> None:
        if not (0 <= self.min_ssim <= 1) or not self.max_adherence_drop >= 0 or math.isnan(self.min_psnr):
            raise ValueError(f"Target {self}: min_ssim in [0, 1], max_adherence_drop >= 0, min_psnr a number")
        if not 0 <= self.min_motion_agreement <= 1:
            raise ValueError(f"Target {self}: min_motion_agreement in [0, 1]")

    def images_needed(self) -> int | None:
        """The fewest evaluation images in which one image changing its adherence moves the share by
        no more than ``max_adherence_drop`` (the drop is judged as a share of the images: 1/n per
        image, so 50 for 2 points); None when no drop is allowed (any set then judges it)."""
        if self.max_adherence_drop <= 0:
            return None
        return math.ceil(1 / self.max_adherence_drop - 1e-9)

    def failures(self, row: dict) -> list[str]:
        out = []
        if row["psnr_min"] < self.min_psnr:
            out.append(f"worst PSNR {row['psnr_min']:.2f} dB < {self.min_psnr:g} dB")
        if row["ssim_min"] < self.min_ssim:
            out.append(f"worst SSIM {row['ssim_min']:.4f} < {self.min_ssim:g}")
        if row.get("adherence") is not None:
            drop = row["plain_adherence"] - row["adherence"]
            if drop > self.max_adherence_drop + 1e-9:
                out.append(
                    f"adherence {row['adherence']:.1%} is {drop * 100:.1f} points below plain "
                    f"{row['plain_adherence']:.1%} (allowed: {self.max_adherence_drop * 100:g})"
                )
        if row.get("motion") is not None and row["motion"] < self.min_motion_agreement - 1e-9:
            out.append(f"motion kept on {row['motion']:.0%} of clips < {self.min_motion_agreement:.0%}")
        return out
