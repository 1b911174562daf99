#!/usr/bin/env python3
"""Add a test-only KV-cache fault to llama.cpp's server source before it is built.

The fault is the one crosstalk exists to catch: a slot treats another request's cached
tokens as the new prompt's prefix, so the model writes its answer on someone else's
context (the stale-prefix failure of llama.cpp #27148 and of the prefix-cache reports in
docs/real-model.md). It stays inert unless ``CROSSTALK_FAULT_RATE`` is set in the server's
environment:

- ``CROSSTALK_FAULT_RATE``: probability (0..1) that a new request on a slot whose cache
  holds another request's tokens keeps those tokens as its own prefix.
- ``CROSSTALK_FAULT_SEED``: seed of the draw (default 0).
- ``CROSSTALK_FAULT_TAIL``: how many of the new prompt's last tokens are always computed
  afresh (default 8), so the model still sees the end of its own prompt ("Reply:").
- ``CROSSTALK_FAULT_LOG``: a JSON-lines file of ground truth, one line a fault:
  ``{"victim": tag, "source": tag, "n_shared": n, "n_stale": n, "n_prompt": n,
  "inherited": bool}``. Tags come from the request body's ``crosstalk_tag`` string,
  which only the test workload sets. A later request whose real prefix reaches into a
  stale region inherits it and is logged too, so no faulted answer goes unrecorded.

Run with the llama.cpp source root: ``llama_fault.py vendor/llama.cpp``. Each edit is
anchored on a line of the pinned release and the script fails if an anchor is missing,
so a version bump cannot silently build a server without the fault.
"""

from __future__ import annotations

import sys
from pathlib import Path

TASK_FIELD = (
    "    std::string crosstalk_tag; // test-only fault injection (scripts/llama_fault.py)\n"
)

SCHEMA_FIELD = """\
    add((new field_str("crosstalk_tag"))
        ->set_desc("Test-only: names the request in the fault-injection log")
        ->set_handler([&](field_eval_context & ctx, const json & data) {
            ctx.params.crosstalk_tag = data.at("crosstalk_tag").get<std::string>();
        }));

"""

SLOT_FIELDS = """\
    // test-only fault injection (scripts/llama_fault.py)
    std::string ct_tag;           // request whose tokens the cache holds
    std::string ct_stale_source;  // request whose KV fills [ct_stale_begin, ct_stale_end)
    int32_t ct_stale_begin = 0;
    int32_t ct_stale_end   = 0;
"""

DECLARE = """\
                        // test-only fault injection (scripts/llama_fault.py)
                        int ct_natural = -1;
                        bool ct_fired = false;
"""

# Placed right after the real common-prefix match, before the checkpoint logic, so a
# checkpoint restore can only shorten the stale region, never make the KV inconsistent.
FIRE = """\
                                {
                                    static const char * ct_rate_s = getenv("CROSSTALK_FAULT_RATE");
                                    static const double ct_rate = ct_rate_s ? atof(ct_rate_s) : 0.0;
                                    static std::mt19937_64 ct_rng(
                                        getenv("CROSSTALK_FAULT_SEED") ? std::stoull(getenv("CROSSTALK_FAULT_SEED")) : 0);
                                    static const int ct_tail =
                                        getenv("CROSSTALK_FAULT_TAIL") ? atoi(getenv("CROSSTALK_FAULT_TAIL")) : 8;
                                    ct_natural = n_past;
                                    const std::string & ct_new = slot.task->params.crosstalk_tag;
                                    if (ct_rate > 0.0 && !ct_new.empty() && !slot.ct_tag.empty() && ct_new != slot.ct_tag) {
                                        std::uniform_real_distribution<double> ct_u(0.0, 1.0);
                                        const int ct_end = std::min<int>((int) slot.prompt.tokens.size(),
                                                                         (int) input_tokens.size() - ct_tail);
                                        if (ct_u(ct_rng) < ct_rate && ct_end > n_past) {
                                            for (int i = n_past; i < ct_end; i++) {
                                                slot.prompt.tokens.set_token(i, input_tokens[i]);
                                            }
                                            n_past = ct_end;
                                            ct_fired = true;
                                        }
                                    }
                                }
"""

RECORD = """\
                        {
                            // test-only fault injection (scripts/llama_fault.py): record ground truth
                            static const char * ct_log = getenv("CROSSTALK_FAULT_LOG");
                            const std::string & ct_new = slot.task->params.crosstalk_tag;
                            std::string ct_source;
                            bool ct_inherited = false;
                            int ct_begin = 0;
                            if (ct_fired && ct_natural >= 0 && n_past > ct_natural) {
                                ct_source = slot.ct_tag;
                                ct_begin = ct_natural;
                            } else if (!ct_fired && slot.ct_stale_end > slot.ct_stale_begin && n_past > slot.ct_stale_begin) {
                                ct_source = slot.ct_stale_source;
                                ct_begin = slot.ct_stale_begin;
                                ct_inherited = true;
                            }
                            if (!ct_source.empty() && ct_source != ct_new) {
                                const int ct_stop = ct_inherited ? std::min<int>(n_past, slot.ct_stale_end) : n_past;
                                if (ct_log) {
                                    std::ofstream ct_f(ct_log, std::ios::app);
                                    ct_f << "{\\"victim\\":\\"" << ct_new << "\\",\\"source\\":\\"" << ct_source
                                         << "\\",\\"n_shared\\":" << ct_begin << ",\\"n_stale\\":" << (ct_stop - ct_begin)
                                         << ",\\"n_prompt\\":" << input_tokens.size()
                                         << ",\\"inherited\\":" << (ct_inherited ? "true" : "false") << "}\\n";
                                }
                                slot.ct_stale_source = ct_source;
                                slot.ct_stale_begin = ct_begin;
                                slot.ct_stale_end = ct_stop;
                            } else {
                                slot.ct_stale_begin = slot.ct_stale_end = 0;
                                slot.ct_stale_source.clear();
                            }
                            slot.ct_tag = ct_new;
                        }

"""

EDITS: list[tuple[str, str, str, str]] = [
    # (file, anchor line, where, text)
    ("tools/server/server-task.h", "    bool return_progress = false;", "after", TASK_FIELD),
    (
        "tools/server/server-schema.cpp",
        '    add((new field_bool("return_progress", params.return_progress))',
        "before",
        SCHEMA_FIELD,
    ),
    ("tools/server/server-context.cpp", "    int64_t t_last_used = -1;", "after", SLOT_FIELDS),
    (
        "tools/server/server-context.cpp",
        "                        int n_past = 0;",
        "after",
        DECLARE,
    ),
    (
        "tools/server/server-context.cpp",
        "                                n_past = slot.prompt.tokens.get_common_prefix(input_tokens);",
        "after",
        FIRE,
    ),
    (
        "tools/server/server-context.cpp",
        "                        // [TAG_PROMPT_LOGITS]",
        "before",
        RECORD,
    ),
]


def apply(root: Path) -> None:
    for name, anchor, where, text in EDITS:
        path = root / name
        lines = path.read_text().splitlines(keepends=True)
        hits = [i for i, line in enumerate(lines) if line.rstrip("\n") == anchor]
        if len(hits) != 1:
            raise SystemExit(
                f"llama_fault: anchor found {len(hits)} times in {name}: {anchor.strip()!r}"
            )
        at = hits[0] + (1 if where == "after" else 0)
        lines[at:at] = [text]
        path.write_text("".join(lines))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: llama_fault.py LLAMA_CPP_SOURCE_ROOT")
    apply(Path(sys.argv[1]))
