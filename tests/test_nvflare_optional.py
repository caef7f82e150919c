"""fastagg.nvflare is optional: ``import fastagg`` never imports NVIDIA FLARE, and without it ``import
fastagg.nvflare`` says what to install. (The aggregator itself is tested in FLARE's own environment:
tests_nvflare/, ``make test-nvflare``; FLARE and Flower pin different protobufs.)"""
import subprocess
import sys


def test_import_fastagg_does_not_import_nvflare_and_fastagg_nvflare_says_what_to_install():
    code = ("import sys, fastagg; assert 'nvflare' not in sys.modules, 'import fastagg imported nvflare'\n"
            "sys.modules['nvflare'] = None\n"
            "try:\n    import fastagg.nvflare\nexcept ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "pip install 'fastagg[nvflare]'" in out.stdout
