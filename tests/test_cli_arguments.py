"""Bad `flashkit` command lines stop with argparse's message and exit status 2, before any work."""

import pytest

from flashkit import cli

BAD = {  # command line -> what the message must name
    "train --steps 0": "--steps",
    "train --lr inf": "--lr",
    "train --heads 3 --embd 64": "--embd",
    "memory --device mps": "--device",
    "memory --device banana": "--device",
    "memory --seqlens 1k,0": "--seqlens",
    "memory --max-gib -1": "--max-gib",
    "bench --headdims x": "--headdims",
    "bench --directions up": "--directions",
    "break-it --logit-stds 1,nan": "--logit-stds",
    "break-it --block 0": "--block",
    "demo --device cuda:x": "--device",
    "learn nothing": "topic",
    "simulate machine --n 0": "--n",
    "simulate machine --program c00 --registers 2": "registers",
    "simulate hbm --tiles 128": "--tiles",
    "simulate hbm --d 1000 --sram-kib 1": "sram",
}


@pytest.mark.parametrize("line", list(BAD))
def test_bad_arguments_exit_with_status_2(line, capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(line.split())
    assert stop.value.code == 2
    assert BAD[line] in capsys.readouterr().err
