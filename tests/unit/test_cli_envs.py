"""``opd envs --module``: a user's environments are listed beside opd's."""

from __future__ import annotations

import textwrap


def test_envs_lists_the_environments_a_users_module_registers(tmp_path, monkeypatch, capsys):
    from opd.cli import main

    (tmp_path / "my_lab_envs.py").write_text(textwrap.dedent('''
        """Registers my lab's environment."""
        import gymnasium
        from environments.frozenlake import FrozenLakeTextEnv


        class BiggerLake(FrozenLakeTextEnv):
            """FrozenLake on my lab's bigger maps."""


        gymnasium.register(id="mylab/BiggerLake-v0", entry_point=BiggerLake)
    '''))
    import gymnasium

    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(__import__("sys").modules, "my_lab_envs", raising=False)
    try:
        assert main(["envs", "--module", "my_lab_envs"]) == 0
    finally:
        gymnasium.registry.pop("mylab/BiggerLake-v0", None)  # leave the registry as other tests expect it
    listed = capsys.readouterr().out
    assert "opd/FrozenLakeText-v0" in listed
    assert any(line.startswith("mylab/BiggerLake-v0") and "FrozenLake on my lab's bigger maps" in line
               for line in listed.splitlines()), listed
    assert main(["envs", "--module", "no_such_module_here"]) == 2
    assert "--module no_such_module_here: cannot import it" in capsys.readouterr().out
