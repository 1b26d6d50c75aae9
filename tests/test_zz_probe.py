from tests.cli_support import loops, seeded  # noqa

def test_probe(seeded, tmp_path):
    s = seeded.server
    r = seeded.run_id
    for args in (["deploy", f"{r}:s2", "--model-name", "m1"], ["deploy", f"{r}:t1"], ["deploy", "list"], ["-o", "json", "deploy", "list"],
                 ["sample", r, "--prompt", "hello", "--max-tokens", "8", "--seed", "1"], ["sample", f"{r}:s1", "--chat", "--prompt", "hi", "-n", "2", "--max-tokens", "8", "-o", "json"],
                 ["checkpoints", "download", f"{r}:s2", "-t", "sampler", "-O", str(tmp_path / "dl")], ["checkpoints", "download", f"{r}:s2", "-t", "sampler", "-O", str(tmp_path / "dl")],
                 ["runs", "logs", r], ["runs", "logs", r, "-o", "json", "--limit", "2"], ["runs", "watch", r, "-o", "jsonl"] ):
        res = loops(s, *args)
        print(args, res)
