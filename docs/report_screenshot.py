"""The HTML equivalence report of a 12-layer port, and a screenshot of it with headless Chromium.

A 12-layer GPT-2 (transformers, tiny widths, random weights) ported to mlx-lm with
``db.transfer``, one bias of the port dropped (``h.7.mlp.c_fc``), compared with
``compare_models(..., isolated=True)``. Writes docs/report_12_layer.png (the page itself, about
0.5 MB, goes to a temporary directory; Debian's ``chromium`` package: ``apt-get install -y chromium``).

    TF_CPP_MIN_LOG_LEVEL=3 .venv/bin/python docs/report_screenshot.py
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
warnings.simplefilter("ignore")

import _compare_ports as P  # noqa: E402
import dense_bridge as db  # noqa: E402

FAULT = "h.7.mlp.c_fc"


def report():
    P.LAYERS = 12  # the ports read the layer count when they build
    src, port = P.torch_gpt2(0), P.mlx_gpt2()
    P.port_gpt2(src, port)
    layer = db.linear_layers(port)[FAULT]
    params = db.get_params(layer)
    db.set_params(layer, {**params, "bias": np.zeros_like(params["bias"])})
    return db.testing.compare_models(src, port, P.lm_inputs(0), mapping=[(r"(.*)", r"\1")], isolated=True)


def main() -> int:
    html_path, png_path = Path(tempfile.mkdtemp()) / "report_12_layer.html", HERE / "report_12_layer.png"
    r = report()
    print(r.verdict())
    r.to_html(html_path)
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        print("no chromium on PATH: apt-get install -y chromium", file=sys.stderr)
        return 1
    # --no-sandbox: CI containers run as root, where Chromium's sandbox refuses to start
    subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    f"--screenshot={png_path}", "--window-size=1400,2300", html_path.as_uri()],
                   check=True, capture_output=True, timeout=120)
    print(f"wrote {html_path} and {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
