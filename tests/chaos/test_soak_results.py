"""The soak writes its section into bench/RESULTS.md: one section per backend, the rest kept."""

from __future__ import annotations

from pathlib import Path

from tests.chaos.harness import ChaosConfig
from tests.chaos.soak import heading, replace_soak_section


def test_each_backends_soak_replaces_only_its_own_section(tmp_path: Path) -> None:
    results = tmp_path / "RESULTS.md"
    results.write_text("# Results\n\n## Timers\n\nt\n\n## Chaos soak (old, 3 min)\n\nembedded old\n\n## Burst\n\nb\n")
    sim = f"{heading(ChaosConfig(backend='mongo-sim'))} (run, 5 min)\n\nsim one\n"
    replace_soak_section(results, sim)
    text = results.read_text()
    assert "embedded old" in text and "sim one" in text
    assert text.index("embedded old") < text.index("sim one") < text.index("## Burst")
    replace_soak_section(results, f"{heading(ChaosConfig())} (new, 3 min)\n\nembedded new\n")
    replace_soak_section(results, sim.replace("sim one", "sim two"))
    text = results.read_text()
    assert "embedded old" not in text and "sim one" not in text
    assert text.count("## Chaos soak") == 2 and "embedded new" in text and "sim two" in text
    assert text.startswith("# Results") and text.rstrip().endswith("b")
