"""Pooling checkpoints for the tests, saved by sentence-transformers itself (the oracle):
seeded tiny BERT encoders with a WordPiece vocabulary and XLM-RoBERTa ones with a byte-level
BPE, cross-encoders of both, and stories260K's decoder as an embedding model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from core.models.default_model import DEFAULT_MODEL_DIR

WORDS = (
    "the a cat dog sat on mat ran to park and she he was happy because sun out birds sang all day long in tall "
    "green trees once upon time there little girl boy red ball big small house went home with her his friend "
    "play played liked likes jump over fox quick brown lazy what is how many people live berlin paris city "
    "museums known for population of"
).split()
SENTENCES = [
    "the cat sat on the mat",
    "a dog ran to the park",
    "she was happy because the sun was out",
    "once upon a time there was a little girl",
    "the quick brown fox jump over the lazy dog",
    "how many people live in berlin",
    "berlin is known for museums",
    "paris is a big city",
    "cat",
    "the birds sang all day long in the tall green trees and the boy played with his red ball",
]


def _vocab_file(directory: Path) -> Path:
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *letters, *(f"##{c}" for c in letters), *WORDS]
    path = directory / "vocab.txt"
    path.write_text("\n".join(dict.fromkeys(vocab)) + "\n")
    return path


def bert_config(num_labels: int | None = None, **overrides):
    import transformers

    settings = dict(
        hidden_size=48, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
        max_position_embeddings=128, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    settings.update(overrides)
    if num_labels is not None:
        settings["num_labels"] = num_labels
    return transformers.BertConfig(vocab_size=0, **settings)


def bert_classifier(directory: Path, labels: tuple[str, ...] = ("negative", "neutral", "positive")) -> str:
    """A seeded random BERT sequence classifier with named labels, saved by transformers."""
    body = _bert_body(directory, 21, num_labels=len(labels),
                      id2label=dict(enumerate(labels)), label2id={name: i for i, name in enumerate(labels)})
    return str(body)


def _bert_body(directory: Path, seed: int, num_labels: int | None = None, **config) -> Path:
    """A seeded random BERT (a classifier with ``num_labels``) and its tokenizer, saved by transformers."""
    import transformers

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = transformers.BertTokenizerFast(str(_vocab_file(directory)))
    cfg = bert_config(num_labels, **config)
    cfg.vocab_size = len(tokenizer)
    torch.manual_seed(seed)
    model_class = transformers.BertForSequenceClassification if num_labels else transformers.BertModel
    model = model_class(cfg).eval()
    with torch.no_grad():  # a random classifier head is near zero: give its scores some range
        for name, param in model.named_parameters():
            if "classifier" in name or "pooler" in name:
                param.normal_(0, 0.5)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def _roberta_body(directory: Path, seed: int, num_labels: int | None = None) -> Path:
    """A seeded random XLM-RoBERTa (a classifier with ``num_labels``) with a byte-level BPE
    tokenizer trained on the test sentences (RoBERTa's special tokens and pair template)."""
    import transformers
    from tokenizers import ByteLevelBPETokenizer
    from tokenizers.processors import RobertaProcessing

    directory.mkdir(parents=True, exist_ok=True)
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        [*SENTENCES, " ".join(WORDS)] * 3, vocab_size=400, min_frequency=1, show_progress=False,
        special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"],
    )
    backend = bpe._tokenizer
    backend.post_processor = RobertaProcessing(("</s>", bpe.token_to_id("</s>")), ("<s>", bpe.token_to_id("<s>")))
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", sep_token="</s>", cls_token="<s>",
        unk_token="<unk>", pad_token="<pad>", mask_token="<mask>",
    )
    config = transformers.XLMRobertaConfig(
        vocab_size=len(tokenizer), hidden_size=48, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
        max_position_embeddings=130, pad_token_id=1, type_vocab_size=1, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, **({"num_labels": num_labels} if num_labels else {}),
    )
    torch.manual_seed(seed)
    model_class = transformers.XLMRobertaForSequenceClassification if num_labels else transformers.XLMRobertaModel
    model = model_class(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "classifier" in name:
                param.normal_(0, 0.5)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def bert_embedder(directory: Path, pooling: str = "mean", normalize: bool = True, seed: int = 11,
                  matryoshka: bool = False) -> str:
    """A sentence-transformers BERT embedder (Transformer, Pooling, optionally Normalize)."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules as models

    body = _bert_body(directory.with_name(directory.name + "-body"), seed)
    transformer = models.Transformer(str(body))
    modules = [transformer, models.Pooling(transformer.get_embedding_dimension(), pooling_mode=pooling)]
    if normalize:
        modules.append(models.Normalize())
    SentenceTransformer(modules=modules, device="cpu").save(str(directory))
    if matryoshka:
        config_file = directory / "config.json"
        config = json.loads(config_file.read_text())
        config["matryoshka_dimensions"] = [16, 32, 48]
        config_file.write_text(json.dumps(config))
    return str(directory)


def bert_cross_encoder(directory: Path, seed: int = 12) -> str:
    """A one-label BERT cross-encoder, saved by sentence-transformers' CrossEncoder."""
    from sentence_transformers import CrossEncoder

    body = _bert_body(directory.with_name(directory.name + "-body"), seed, num_labels=1)
    CrossEncoder(str(body), device="cpu").save(str(directory))
    return str(directory)


def roberta_embedder(directory: Path, pooling: str = "cls", seed: int = 13) -> str:
    """A sentence-transformers XLM-RoBERTa embedder (positions after the padding id), normalised."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules as models

    body = _roberta_body(directory.with_name(directory.name + "-body"), seed)
    transformer = models.Transformer(str(body))
    modules = [transformer, models.Pooling(transformer.get_embedding_dimension(), pooling_mode=pooling),
               models.Normalize()]
    SentenceTransformer(modules=modules, device="cpu").save(str(directory))
    return str(directory)


def roberta_cross_encoder(directory: Path, seed: int = 14) -> str:
    """A one-label XLM-RoBERTa cross-encoder (RoBERTa's own classification head)."""
    from sentence_transformers import CrossEncoder

    body = _roberta_body(directory.with_name(directory.name + "-body"), seed, num_labels=1)
    CrossEncoder(str(body), device="cpu").save(str(directory))
    return str(directory)


def llama_embedder(directory: Path, pooling: str = "lasttoken") -> str:
    """stories260K's decoder as a sentence-transformers embedder (saved headless: LlamaModel).

    Without its chat template: sentence-transformers 6 wraps every text of a model that has one
    in a chat message before tokenizing, which a server's embeddings of plain text do not do."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules as models

    source = directory.with_name(directory.name + "-source")
    shutil.copytree(DEFAULT_MODEL_DIR, source, ignore=shutil.ignore_patterns("chat_template.jinja"))
    transformer = models.Transformer(str(source))
    tokenizer = transformer.tokenizer
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.unk_token
    modules = [transformer, models.Pooling(transformer.get_embedding_dimension(), pooling_mode=pooling),
               models.Normalize()]
    SentenceTransformer(modules=modules, device="cpu").save(str(directory))
    return str(directory)
