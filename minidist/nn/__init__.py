"""Neural-network building blocks: Module, layers, attention and a GPT decoder."""

from minidist.nn.attention import CausalSelfAttention, merge_heads, split_heads
from minidist.nn.gpt import GPT, Block, Embed, GPTConfig, Head
from minidist.nn.layers import MLP, Dropout, Embedding, LayerNorm, Linear
from minidist.nn.module import Module, ModuleList, Parameter, Sequential

__all__ = ["GPT", "MLP", "Block", "CausalSelfAttention", "Dropout", "Embed", "Embedding", "GPTConfig",
           "Head", "LayerNorm", "Linear", "Module", "ModuleList", "Parameter", "Sequential",
           "merge_heads", "split_heads"]
