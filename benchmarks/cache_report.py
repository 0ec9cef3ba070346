"""bench_cache.py's report: its table rows, byte account and the figures the docs quote,
from the runs it made (no process is started here)."""
import os

import numpy as np

from id_streams import SIZES


def headline(rec, jobs, names, links, bounds, consistency, servers):
    """The figures the documentation quotes: the first cache of the schedule against no
    cache in the last job (``servers`` x as many trainers), per link when one stream ran,
    per stream when one link did (both, dotted, when several of each); bytes, hit rate
    and CPU of each stream on the first link."""
    trainers = 2 if servers == 2 else 1
    for (sname, link), (none, cache) in ((k, v[:2]) for k, v in jobs.items()):
        where = ".".join(([sname] if len(names) > 1 else []) +
                         ([link] if len(links) > 1 else []))
        rec.figure(f"vs_no_cache.{where or link}", cache[3], "{:.2f}x",
                   f"{cache[0]}, {cache[1]}: steps/s over the uncached runs beside it")
        if link != links[0]:
            continue
        tag = f".{sname}" if len(names) > 1 else ""
        rec.figure(f"fewer_bytes{tag}", 100 * cache[5], "{:.0f}%",
                   f"{cache[0]}, {cache[1]}: fewer bytes received per step and trainer "
                   f"({cache[4] / 1e6:.2f} MB instead of {none[4] / 1e6:.2f})")
        rec.figure(f"fewer_bytes_both_ways{tag}",
                   100 * (1 - (cache[4] + cache[6]) / (none[4] + none[6])), "{:.0f}%",
                   "the same, bytes sent and received")
        rec.figure(f"hit_rate{tag}", 100 * cache[7], "{:.0f}%",
                   "% of a step's unique rows served from the cache")
        job_cpu = [trainers * r[8] + r[9] for r in (none, cache)]
        rec.figure(f"cpu_more{tag}", 100 * (job_cpu[1] / job_cpu[0] - 1), "{:.0f}%",
                   f"CPU per step of the whole job (trainers and servers) with the cache, "
                   f"more than without ({job_cpu[1]:.1f} against {job_cpu[0]:.1f} ms)")
        bound = bounds.get(sname + (" (sync_exact with summed rows, 2 trainers)"
                                    if consistency == "sync_exact" else " (exact, 2 trainers)"))
        if trainers == 2 and bound:
            rec.figure(f"hit_bound{tag}", 100 * bound[0], "{:.0f}%",
                       "the clairvoyant bound of any cache of that size under this protocol "
                       "with 2 trainers")


def slug(name):
    """A name as part of a figure name: 'lfu 10% exact' -> 'lfu_10_exact'."""
    return "_".join("".join(c if c.isalnum() else " " for c in name.lower()).split())


def print_account(job, runs, configs):
    """Array bytes per step and trainer by request kind and array, first round; and the
    socket's bytes (frame headers included) beside them."""
    print(f"\nbyte account, {job}: bytes per step per trainer (first round; array i of "
          "each request and of its reply)")
    for c, (name, _) in enumerate(configs):
        run = runs[2 * c - 1 if c else 0]
        keys = sorted({k for r in run for k in r["account"]})
        parts = {k: float(np.mean([r["account"].get(k, 0) for r in run])) for k in keys}
        shown = "; ".join(f"{k} {v / 1e3:.1f} kB" for k, v in parts.items() if v >= 50)
        print(f"  {name}: socket sent {np.mean([r['sent_per_step'] for r in run]) / 1e3:.1f} "
              f"kB, received {np.mean([r['received_per_step'] for r in run]) / 1e3:.1f} kB; "
              f"{shown}")


def summarize(job, runs, configs, k, rounds):
    """Table rows of one job: no cache, then each cache against its two neighbours."""
    res = [dict(rate=float(np.mean([r["steps_per_s"] for r in run])),
                recv=float(np.mean([r["received_per_step"] for r in run])),
                sent=float(np.mean([r["sent_per_step"] for r in run])),
                hit=float(np.mean([r.get("hit_rate", 0.0) for r in run])),
                cpu=float(np.mean([r["cpu_ms_per_step"] for r in run])),
                scpu=float(np.sum([r["server_cpu_ms_per_step"] for r in run]))) for run in runs]
    base = [res[r * k + j] for r in range(rounds) for j in range(0, k, 2)]
    none = (job, "no cache", float(np.median([b["rate"] for b in base])), 1.0,
            float(np.median([b["recv"] for b in base])), 0.0,
            float(np.median([b["sent"] for b in base])), 0.0,
            float(np.median([b["cpu"] for b in base])),
            float(np.median([b["scpu"] for b in base])))
    rows = [none]
    for c, (name, _) in enumerate(configs):
        at = [r * k + 2 * c + 1 for r in range(rounds)]
        mine = [res[i] for i in at]
        ratio = [res[i]["rate"] / (0.5 * (res[i - 1]["rate"] + res[i + 1]["rate"]))
                 for i in at]

        def med(key, mine=mine):
            return float(np.median([r[key] for r in mine]))

        rows.append((job, name, med("rate"), float(np.median(ratio)), med("recv"),
                     1 - med("recv") / none[4], med("sent"), med("hit"), med("cpu"),
                     med("scpu")))
    return rows


def plot(rates, path):
    """Hit rate against cache size per (stream, policy) of ``rates``, as a PNG at ``path``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for (sname, policy), r in rates.items():
        style = {"lru": "-", "lfu": "--"}.get(policy, ":")
        ax.plot([100 * s for s in SIZES], [100 * x for x in r], marker="o",
                linestyle=style, label=f"{sname} ids, {policy}")
    ax.set_xscale("log")
    ax.set_xlabel("cache size (% of the table's rows)")
    ax.set_ylabel("hit rate (% of unique rows per step)")
    ax.set_title("Trainer cache on WordNet, exact mode, 1 trainer")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
