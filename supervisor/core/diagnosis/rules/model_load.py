"""The model cannot be loaded."""

from __future__ import annotations

import re

from supervisor.core.diagnosis.rule import _ci, _loader_context, _Rule
from supervisor.core.model import Cause

RULES: tuple[_Rule, ...] = (
    # -- the model cannot be loaded
    _Rule(
        "model_files",
        Cause.MODEL_LOAD_ERROR,
        (
            "are not supported for now", "is not supported for now", "unsupported architectures:",
            "does not recognize this architecture",
            "unrecognized model in", "failed to be inspected", "safetensorerror",
            "error while deserializing header", "headertoolarge", "metadataincompletebuffer",
            "incomplete metadata", "does not appear to have a file named", "is not a valid model identifier",
            "repository not found", "gatedrepoerror", "can't load the configuration", "can't load tokenizer",
            "error(s) in loading state_dict", "size mismatch for", "unrecognized configuration class",
            "pytorchstreamreader failed", "invalid load key", "not a local folder and is not a valid model identifier",
            "repo id must be in the form", "hfvalidationerror",
        ),
        origin="hf",
        origins=(
            ("are not supported for now", "sglang"), ("is not supported for now", "sglang-legacy"),
            ("unsupported architectures:", "sglang-legacy"), ("failed to be inspected", "vllm"),
            ("safetensorerror", "safetensors"), ("error while deserializing header", "safetensors"),
            ("headertoolarge", "safetensors"), ("metadataincompletebuffer", "safetensors"),
            ("incomplete metadata", "safetensors"), ("error(s) in loading state_dict", "torch"),
            ("size mismatch for", "torch"), ("pytorchstreamreader failed", "torch"), ("invalid load key", "python"),
        ),
        cites=(("are not supported for now", "sglang 0.5.23 srt/models/registry.py:63: 'Model architectures <*> are not supported for now. Supported architectures: <*>'"),
               
            ("is not supported for now", "sglang <= 0.4 model_config: 'Model architectures [...] is not supported for now'"),
            ("unsupported architectures:", "sglang 0.3.6.post3 srt/model_executor/model_runner.py:736: 'Unsupported architectures: <*>. Supported list: <*>'"),
            ("does not recognize this architecture", "transformers 5.19.0 models/auto/configuration_auto.py:430: 'The checkpoint you are trying to load has model type `<*>` but Transformers does not recog'"),
            ("unrecognized model in", "transformers 5.19.0 models/auto/configuration_auto.py:442: 'Unrecognized model in <*>. Should have a `model_type` key in its <*>.'"),
            ("failed to be inspected", "vllm/model_executor/models/registry.py: 'Model architectures %s failed to be inspected'"),
            ("safetensorerror", "safetensors_rust.SafetensorError"),
            ("error while deserializing header", "safetensors: 'Error while deserializing header: %s'"),
            ("headertoolarge", "safetensors: HeaderTooLarge"), ("metadataincompletebuffer", "safetensors: MetadataIncompleteBuffer"),
            ("incomplete metadata", "safetensors: 'incomplete metadata, file not fully covered'"),
            ("does not appear to have a file named", "transformers 5.19.0 modeling_utils.py:738: '<*> does not appear to have a file named <*> but there is a file without the variant <*>. '"),
            ("is not a valid model identifier", "transformers 5.19.0 utils/hub.py:569: '<*> is not a local folder and is not a valid model identifier listed on ’https:/<path>’'"),
            ("not a local folder and is not a valid model identifier", "transformers 5.19.0 utils/hub.py:569: '<*> is not a local folder and is not a valid model identifier listed on ’https:/<path>’'"),
            ("repository not found", "huggingface_hub RepositoryNotFoundError: 'Repository Not Found'"),
            ("gatedrepoerror", "huggingface_hub.errors.GatedRepoError"),
            ("can't load the configuration", "transformers 5.19.0 configuration_utils.py:864: 'Can’t load the configuration of ’<*>’. If you were trying to load it from ’https:/<path>’,'"),
            ("can't load tokenizer", "transformers 5.19.0 tokenization_utils_base.py:1728: 'Can’t load tokenizer for ’<*>’. If you were trying to load it from ’https:/<path>’, make s'"),
            ("error(s) in loading state_dict", "torch 2.14.1 nn/modules/module.py:2643: 'Error(s) in loading state_dict for <*>:'"),
            ("size mismatch for", "torch/nn/modules/module.py: 'size mismatch for %s'"),
            ("unrecognized configuration class", "transformers 5.19.0 models/auto/auto_factory.py:255: 'Unrecognized configuration class <*> for this kind of AutoModel: <*>.'"),
            ("pytorchstreamreader failed", "caffe2/serialize/inline_container.cc: 'PytorchStreamReader failed reading zip archive'"),
            ("invalid load key", "CPython pickle: \"invalid load key, '%c'.\""),
            ("repo id must be in the form", "huggingface_hub 1.33.0 utils/_validators.py:133: 'Repo id must be in the form ’repo_name’ or ’namespace/repo_name’: ’<*>’. Use `repo_type` a'"),
            ("hfvalidationerror", "huggingface_hub.errors.HFValidationError"),
        ),
    ),
    _Rule(
        "model_path",
        Cause.MODEL_LOAD_ERROR,
        ("no such file or directory",),
        pattern=_ci(
            r"no such file or directory[^\n]{0,300}?"
            r"(?:safetensors|\.bin\b|\.pt\b|\.gguf|config\.json|tokenizer|/models?/)"
        ),
        origin="kernel",
        cites=(("no such file or directory", "glibc strerror(ENOENT): 'No such file or directory'"),),
    ),
    _Rule(  # a checkpoint that does not match the model code
        "loader_mismatch",
        Cause.MODEL_LOAD_ERROR,
        ("keyerror", "assertionerror"),
        pattern=re.compile(r"(?<![\w.])(?:KeyError|AssertionError)\b"),
        context=_loader_context,
        origin="python",
        cites=(("keyerror", "CPython builtin KeyError, raised in a load_weights frame"),
               ("assertionerror", "CPython builtin AssertionError, raised in a load_weights frame")),
    ),
)
