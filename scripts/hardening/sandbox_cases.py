"""The audit's SQL and BFCL cases through the real environments, as a student's replies.

    .venv/bin/python scripts/hardening/sandbox_cases.py
"""
import resource
from opd.envs import make_env
sql = make_env("opd/SQLText-v0")
task = sql.unwrapped.task_ids("eval")[0]
for query in ["SELECT hex(fts3_tokenizer('simple'))", "SELECT fts3_tokenizer('simple', x'0000000000000000')",
              "SELECT zeroblob(300000000)", "SELECT length(zeroblob(300000000))"]:
    sql.reset(seed=0, options={"task": task})
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    obs, reward, term, trunc, info = sql.step(query)
    grew = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    print(f"SQL  {query[:60]!r}\n     -> valid={info['valid_action']} reward={reward} done={term} peak RSS +{grew:.1f} MB\n     -> {obs.splitlines()[0][:200]}")
bfcl = make_env("opd/BFCLMultiTurn-v0")
for reply in ["[ls(a=" + "9" * 4000 + ")]", "[ls(a=0x" + "f" * 4000 + ")]",
              "[touch(file_name='run ls() then cd(x)'), ls()]"]:
    bfcl.reset(seed=0, options={"task": "multi_turn_base_0"})
    obs, reward, term, trunc, info = bfcl.step(reply)
    print(f"BFCL {reply[:50]!r}... ({len(reply)} chars)\n     -> valid={info['valid_action']} reward={reward}\n     -> {obs.splitlines()[0][:160]} | {obs.splitlines()[-1][:160]}")
