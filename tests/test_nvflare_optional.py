"""fastagg.nvflare is optional: ``import fastagg`` never imports NVIDIA FLARE, and without it ``import
fastagg.nvflare`` says what to install. (The aggregator itself is tested in FLARE's own environment:
tests_nvflare/, ``make test-nvflare``, with fastagg installed from its wheel.)"""
from fastagg.testing import import_without


def test_import_fastagg_does_not_import_nvflare_and_fastagg_nvflare_says_what_to_install():
    said = import_without("nvflare", "fastagg.nvflare")
    assert "pip install '.[nvflare]'" in said and "pip install 'nvflare" in said and "fastagg[" not in said, said
