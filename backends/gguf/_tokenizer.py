"""The tokenizer metadata llama.cpp needs, made from the source's tokenizer files by the libraries
that read them: sentencepiece for a ``tokenizer.model`` (llama.cpp's "llama" tokenizer: pieces,
scores, types), transformers' tokenizer for a BPE ``tokenizer.json`` ("gpt2": tokens, types,
merges), gguf-py's ``SpecialVocab`` for the special ids, ``add_*_token`` flags, merges and the chat
template. What is missing is refused by name.

A BPE tokenizer's pre-tokenizer name is derived as llama.cpp's converter derives it: the tokenizer's
encoding of the converter's fixed text, hashed (sha256 of the ids' ``str``), looked up in the
converter's own table, read from its source where it is installed (``DENSE_BRIDGE_LLAMA_CPP`` names
its directory); an unknown hash, or no converter, is refused naming the hash.
"""
from __future__ import annotations

import ast
import hashlib
import os
import shutil
import tempfile

from dense_bridge.adapter_kit import ConversionError

#: Environment variable naming a llama.cpp source directory (its ``convert_hf_to_gguf.py``).
ENV = "DENSE_BRIDGE_LLAMA_CPP"
TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
                   "generation_config.json", "config.json")


def llama_cpp_dir() -> str | None:
    """llama.cpp's source directory (holding ``convert_hf_to_gguf.py``), where one is known."""
    candidates = [os.environ.get(ENV)]
    try:
        import llama_cpp

        root = os.path.dirname(llama_cpp.__file__)
        candidates += [os.path.join(root, "vendor", "llama.cpp"), os.path.join(os.path.dirname(root), "vendor", "llama.cpp")]
    except ImportError:
        pass
    for c in candidates:
        if c and os.path.isfile(os.path.join(c, "convert_hf_to_gguf.py")):
            return c
    return None


def _pre_table(root: str) -> tuple[str, dict[str, str]]:
    """(the fixed text, {hash: pre-tokenizer name}) read from the converter's ``get_vocab_base_pre``."""
    for rel in (os.path.join("conversion", "base.py"), "convert_hf_to_gguf.py"):
        path = os.path.join(root, rel)
        if not os.path.isfile(path):
            continue
        from dense_bridge.checkpoints._guard import input_file

        with input_file(path, what="llama.cpp converter source") as f:
            tree = ast.parse(f.read().decode("utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name == "get_vocab_base_pre":
                text, table = None, {}
                for sub in ast.walk(node):
                    if isinstance(sub, ast.Assign) and getattr(sub.targets[0], "id", None) == "chktxt":
                        text = ast.literal_eval(sub.value)
                    if isinstance(sub, ast.If) and isinstance(sub.test, ast.Compare) \
                            and getattr(sub.test.left, "id", None) == "chkhsh":
                        h = ast.literal_eval(sub.test.comparators[0])
                        for stmt in sub.body:
                            if isinstance(stmt, ast.Assign) and getattr(stmt.targets[0], "id", None) == "res":
                                table[h] = ast.literal_eval(stmt.value)
                if text is not None:
                    return text, table
    raise ConversionError(f"{root}: no get_vocab_base_pre found in llama.cpp's converter")


def pre_tokenizer_name(tokenizer) -> str:
    """llama.cpp's name of a BPE tokenizer's pre-tokenizer (see the module docstring)."""
    root = llama_cpp_dir()
    if root is None:
        raise ConversionError("a BPE tokenizer's pre-tokenizer name is looked up in llama.cpp's converter, which is "
                              f"not found: set {ENV} to a llama.cpp source directory (or install llama-cpp-python)")
    text, table = _pre_table(root)
    digest = hashlib.sha256(str(tokenizer.encode(text)).encode()).hexdigest()
    if digest not in table:
        raise ConversionError(f"llama.cpp's converter ({root}) does not know this BPE tokenizer's pre-tokenizer "
                              f"(hash {digest} of its encoding of the converter's fixed text): llama.cpp could not "
                              "tokenize like it, so no GGUF file is written")
    return table[digest]


def _looks_special(token: str) -> bool:
    """Whether an added token that its tokenizer does not mark special is one in practice (chat and
    reserved markers: ``<|...|>``, ``<unused...>``, ``<pad>``, ``<mask>``): llama.cpp's converter types
    those as control tokens, and so do we, so the files agree."""
    return (token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]") or (token.startswith("<|") and token.endswith("|>"))
            or (token.startswith("<\uff5c") and token.endswith("\uff5c>"))
            or (token.startswith("<unused") and token.endswith(">")))


def _spm(path: str, vocab_size: int) -> dict:
    """The token list of a SentencePiece model ``path`` as llama.cpp reads it, ``vocab_size`` long:
    the model's pieces, then the tokens added beside it (``added_tokens.json``, and
    ``tokenizer_config.json``'s ``added_tokens_decoder``, both in the same directory) at their ids,
    the rest ``[PAD<id>]`` (unused). Returns the ``tokenizer.ggml.*`` values."""
    import gguf
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor()
    sp.LoadFromFile(path)
    T = gguf.TokenType
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    scores, types = [-10000.0] * vocab_size, [int(T.UNUSED)] * vocab_size
    for i in range(min(sp.vocab_size(), vocab_size)):  # pieces past the embedding's rows have no vector
        tokens[i] = sp.IdToPiece(i)
        scores[i] = float(sp.GetScore(i))
        kind = T.NORMAL
        if sp.IsUnknown(i):
            kind = T.UNKNOWN
        elif sp.IsControl(i):
            kind = T.CONTROL
        elif sp.IsUnused(i):
            kind = T.UNUSED
        elif sp.IsByte(i):
            kind = T.BYTE
        types[i] = int(kind)
    directory = os.path.dirname(path)
    added = _json(os.path.join(directory, "added_tokens.json"))
    for text, i in (added.items() if isinstance(added, dict) else ()):
        if isinstance(i, int) and 0 <= i < vocab_size and isinstance(text, str):
            tokens[i], scores[i], types[i] = text, -1000.0, int(T.USER_DEFINED)
    decoder = _json(os.path.join(directory, "tokenizer_config.json")).get("added_tokens_decoder") or {}
    for key, data in (decoder.items() if isinstance(decoder, dict) else ()):
        i, text = int(key) if str(key).isdigit() else -1, (data or {}).get("content") if isinstance(data, dict) else None
        if not (0 <= i < vocab_size and isinstance(text, str)):
            continue
        if data.get("special") or _looks_special(text):
            types[i] = int(T.CONTROL)
        else:  # a user-defined token is matched on text whose spaces SentencePiece has not yet marked
            text, types[i] = text.replace("\u2581", " "), int(T.USER_DEFINED)
        tokens[i], scores[i] = text, -1000.0
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": "default", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": scores, "tokenizer.ggml.token_type": types}


def _json(path: str) -> dict:
    """The JSON object in ``path``, or {} where there is none (a tokenizer file is optional)."""
    if not os.path.isfile(path):
        return {}
    from dense_bridge.checkpoints._safetensors import read_json_file

    return read_json_file(path, "tokenizer file")  # bounded, checked, a clear error for a broken file


def _bpe(directory: str, vocab_size: int) -> dict:
    import gguf
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(directory)
    pre = pre_tokenizer_name(tok)
    reverse = {i: t for t, i in tok.get_vocab().items()}
    added = tok.get_added_vocab()
    decoder = tok.added_tokens_decoder
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(int(gguf.TokenType.UNUSED))
            continue
        t = reverse[i]
        if t in added:
            types.append(int(gguf.TokenType.CONTROL if decoder[i].special else gguf.TokenType.USER_DEFINED))
        else:
            types.append(int(gguf.TokenType.NORMAL))
        tokens.append(t)
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types}


def metadata(extras: dict[str, str] | None, config: dict) -> dict:
    """The ``tokenizer.*`` metadata {key: (value, GGUF value type, array sub type)} from the source's
    tokenizer files ``extras`` {name: path}; ``{}`` for None (a twin). ConversionError naming what
    is missing."""
    if extras is None:
        return {}
    import gguf

    arch = config["metadata"]["general.architecture"]
    vocab = config["metadata"].get(f"{arch}.vocab_size")
    have = sorted(n for n in extras if n in TOKENIZER_FILES)
    if "tokenizer.model" not in extras and "tokenizer.json" not in extras:
        raise ConversionError(f"llama.cpp needs the tokenizer in the GGUF file, but the source has no tokenizer.model "
                              f"or tokenizer.json (it has {have}): nothing was written")
    with tempfile.TemporaryDirectory(prefix="dense-bridge-tok-") as tmp:
        for n in have:
            shutil.copyfile(extras[n], os.path.join(tmp, n))
        if not isinstance(vocab, int):
            raise ConversionError(f"the {arch!r} config gives no vocab_size for the tokenizer's token list")
        out = _spm(os.path.join(tmp, "tokenizer.model"), vocab) if "tokenizer.model" in extras else _bpe(tmp, vocab)
        special = gguf.SpecialVocab(tmp, load_merges=out["tokenizer.ggml.model"] == "gpt2", n_vocab=vocab)
    if out["tokenizer.ggml.model"] == "gpt2" and not special.merges:
        raise ConversionError("the BPE tokenizer has no merges (tokenizer.json model.merges or merges.txt): "
                              "llama.cpp cannot tokenize without them")
    # written by gguf-py's own writer methods, so every key and value type is the one llama.cpp reads
    w = gguf.GGUFWriter(None, arch)
    w.add_tokenizer_model(out["tokenizer.ggml.model"])
    w.add_tokenizer_pre(out["tokenizer.ggml.pre"])
    w.add_token_list(out["tokenizer.ggml.tokens"])
    if "tokenizer.ggml.scores" in out:
        w.add_token_scores(out["tokenizer.ggml.scores"])
    w.add_token_types(out["tokenizer.ggml.token_type"])
    special.add_to_gguf(w, quiet=True)
    return {k: (v.value, v.type, v.sub_type) for k, v in w.kv_data[0].items()}
