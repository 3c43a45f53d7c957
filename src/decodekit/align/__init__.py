"""Inference-time alignment theory (seed 000): best-of-n, tilting, preferences.

    from decodekit.align import bon_kl, bon_kl_bound, bon_win_rate, beta_for_kl
    bon_kl([0.5, 0.5], [0, 1], n=4)        # exact KL(pi_4 || p) = log 2 - h(2^-4)

Controlled decoding (Mudgal et al. 2024): a prefix value V trained by CD-FUDGE or CD-Q
(`align.value`: an embedding bag on token ids; `align.qvalue`: a Q head on the model's
hidden states); token-wise decoding with it is a sampling adapter for `generate`
(`ValueTilt`, `align.controlled`), blockwise decoding a Generator (`BlockwiseCD`,
`align.blockwise`); the reward–KL frontier on the Shakespeare model is `align.frontier`
(`decodekit eval alignment`).
"""

from decodekit.align.blockwise import BlockwiseCD
from decodekit.align.bon import (
    blockwise_kl_bound,
    bon_kl,
    bon_kl_bound,
    bon_kl_estimate,
    bon_kl_max,
    bon_kl_mc,
    bon_n_for_kl,
    bon_pmf,
    bon_win_rate,
    bon_win_rate_bound,
    bon_win_rate_mc,
)
from decodekit.align.controlled import (
    ValueTilt,
    keyword_reward,
    kl_terms,
    newline_length_reward,
    orm_reward,
    sample_base,
    style_reward,
)
from decodekit.align.preference import (
    bt_probability,
    bt_to_elo,
    elo_expected,
    elo_ratings,
    elo_to_bt,
    elo_update,
    fit_bradley_terry,
)
from decodekit.align.qvalue import HiddenValue, QHead, add_hidden_states, train_q_cdq, train_q_fudge
from decodekit.align.tilt import beta_for_kl, mismatched_tilt, tilt, tilt_kl_max
from decodekit.align.value import PrefixValue, train_cdq, train_fudge

__all__ = [
    "BlockwiseCD",
    "HiddenValue",
    "PrefixValue",
    "QHead",
    "ValueTilt",
    "beta_for_kl",
    "blockwise_kl_bound",
    "add_hidden_states",
    "bon_kl",
    "bon_kl_bound",
    "bon_kl_estimate",
    "bon_kl_max",
    "bon_kl_mc",
    "bon_n_for_kl",
    "bon_pmf",
    "bon_win_rate",
    "bon_win_rate_bound",
    "bon_win_rate_mc",
    "bt_probability",
    "bt_to_elo",
    "elo_expected",
    "elo_ratings",
    "elo_to_bt",
    "elo_update",
    "fit_bradley_terry",
    "keyword_reward",
    "kl_terms",
    "mismatched_tilt",
    "newline_length_reward",
    "orm_reward",
    "sample_base",
    "style_reward",
    "tilt",
    "tilt_kl_max",
    "train_cdq",
    "train_fudge",
    "train_q_cdq",
    "train_q_fudge",
]
