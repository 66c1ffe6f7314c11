"""Prompts of exact token lengths, built with the served model's tokenizer from a word list.

Only words that are one token both at the start of a text and after a space are kept: the
byte-level BPE pre-tokenizer splits text at spaces, so n such words joined by spaces are
exactly n tokens, and a shared prefix followed by " " + question tokenizes to the prefix's
tokens followed by the question's (which is what prefix caching needs). Every prompt is
re-encoded and checked, so a tokenizer for which this does not hold fails loudly.

Uses the ``tokenizers`` library on ``tokenizer.json`` only: no transformers, no torch in the
Locust process.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

WORDS = """
the of and to in is was for on are with as by at from this that have not but they which
one all were her there been has when who will more would out their what about some time
than into only other new could very these two may first then any like now such over also
back after use most made well way even many before must through where much good should
well long work year day great small old people world place life part house under state
line water hand city point world right three home light still found school study learn
plant cover food earth eye never last door between tree cross farm hard start might story
saw far sea draw left late run while press close night real north book carry took science
eat room friend began idea fish mountain stop once base hear horse cut sure watch color face
wood main open seem together next white children begin got walk example ease paper group
always music those both mark often letter until mile river car feet care second enough plain
girl usual young ready above ever red list though feel talk bird soon body dog family direct
pose leave song measure state product black short number class wind question happen complete
ship area half rock order fire south problem piece told knew pass since top whole king space
heard best hour better true during hundred five remember step early hold west ground interest
reach fast five sing listen six table travel less morning ten simple several toward war lay
against pattern slow center love person money serve appear road map rain rule govern pull
cold notice voice unit power town fine certain fly fall lead cry dark machine note wait plan
figure star box noun field rest correct able pound done beauty drive stood contain front
teach week final gave green quick develop ocean warm free minute strong special mind behind
clear tail produce fact street inch multiply nothing course stay wheel full force blue object
decide surface deep moon island foot system busy test record boat common gold possible plane
dry wonder laugh thousand ago ran check game shape equate hot miss brought heat snow tire
bring yes distant fill east paint language among grand ball yet wave drop heart present heavy
dance engine position arm wide sail material size vary settle speak weight general ice matter
circle pair include divide syllable felt perhaps pick sudden count square reason length
represent art subject region energy hunt probable bed brother egg ride cell believe fraction
forest sit race window store summer train sleep prove lone leg exercise wall catch mount wish
sky board joy winter sat written wild instrument kept glass grass cow job edge sign visit past
soft fun bright gas weather month million bear finish happy hope flower clothe strange gone
jump baby eight village meet root buy raise solve metal whether push seven paragraph third
shall held hair describe cook floor either result burn hill safe cat century consider type law
bit coast copy phrase silent tall sand soil roll temperature finger industry value fight lie
beat excite natural view sense ear else quite broke case middle kill son lake moment scale loud
spring observe child straight consonant nation dictionary milk speed method organ pay age
section dress cloud surprise quiet stone tiny climb cool design poor lot experiment bottom key
iron single stick flat twenty skin smile crease hole trade melody trip office receive row mouth
exact symbol die least trouble shout except wrote seed tone join suggest clean break lady yard
rise bad blow oil blood touch grew cent mix team wire cost lost brown wear garden equal sent
choose fell fit flow fair bank collect save control decimal gentle woman captain practice
separate difficult doctor please protect noon whose locate ring character insect caught period
indicate radio spoke atom human history effect electric expect crop modern element hit student
corner party supply bone rail imagine provide agree thus capital chair danger fruit rich thick
soldier process operate guess necessary sharp wing create neighbor wash bat rather crowd corn
compare poem string bell depend meat rub tube famous dollar stream fear sight thin triangle
planet hurry chief colony clock mine tie enter major fresh search send yellow gun allow print
dead spot desert suit current lift rose continue block chart hat sell success company subtract
event particular deal swim term opposite wife shoe shoulder spread arrange camp invent cotton
born determine quart nine truck noise level chance gather shop stretch throw shine property
column molecule select wrong gray repeat require broad prepare salt nose plural anger claim
""".split()


class PromptFactory:
    def __init__(self, tokenizer_file: str | Path) -> None:
        self.tokenizer = Tokenizer.from_file(str(tokenizer_file))
        self.words = self._single_token_words()
        if len(self.words) < 64:
            raise RuntimeError(f"only {len(self.words)} single-token words for this tokenizer")

    @classmethod
    def for_model(cls, model_dir: str | Path) -> "PromptFactory":
        return cls(Path(model_dir) / "tokenizer.json")

    def _single_token_words(self) -> list[str]:
        seen: set[str] = set()
        words = []
        for word in WORDS:
            if word in seen:
                continue
            seen.add(word)
            if len(self.tokenizer.encode(word).ids) == 1 and len(self.tokenizer.encode(" " + word).ids) == 1:
                words.append(word)
        return words

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text).ids)

    def text(self, num_tokens: int, rng: np.random.Generator) -> str:
        """A text of exactly ``num_tokens`` tokens (words drawn with ``rng``)."""
        if num_tokens < 1:
            raise ValueError("num_tokens must be >= 1")
        picks = rng.integers(0, len(self.words), size=num_tokens)
        text = " ".join(self.words[i] for i in picks)
        if self.count(text) != num_tokens:  # the property the module docstring relies on
            raise RuntimeError(f"built a {self.count(text)}-token prompt where {num_tokens} were asked")
        return text

    @staticmethod
    def join(*parts: str) -> str:
        """Concatenate texts so that their token counts add up (see the module docstring)."""
        return " ".join(parts)


def model_max_len(model_dir: str | Path) -> int:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return int(config.get("max_position_embeddings", 2048))
