"""verl's keys of the policy loss, rollout correction and pf_ppo load as verl's launch scripts write them, and mean
what they mean there (trainer/config/losses.py); what verl itself rejects is refused in one line naming the key."""

import pytest

from trainer.config import ConfigError, load_config

ARO = "actor_rollout_ref"
CORRECTION = "algorithm.rollout_correction"


def problems(overrides: list[str]) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        load_config(None, overrides)
    return [str(problem) for problem in caught.value.problems]


def test_the_loss_mode_scripts_lines_load():
    """The lines of verl's examples (cispo, gmpo, gpg, gspo, sapo trainers; ppo_trainer's pfppo script)."""
    cispo = load_config(None, [f"{ARO}.actor.policy_loss.loss_mode=cispo", f"{ARO}.actor.clip_ratio_low=10",
                               f"{ARO}.actor.clip_ratio_high=0.2"])
    assert cispo.actor_rollout_ref.actor.policy_loss.loss_mode == "cispo"
    assert cispo.actor_rollout_ref.actor.clip_range == (10, 0.2)  # no lower end to CISPO's clip, as verl runs it
    sapo = load_config(None, [f"{ARO}.actor.tau_pos=1.0", f"{ARO}.actor.tau_neg=1.05",
                              f"{ARO}.actor.policy_loss.loss_mode=sapo"])
    assert (sapo.actor_rollout_ref.actor.tau_pos, sapo.actor_rollout_ref.actor.tau_neg) == (1.0, 1.05)
    covariance = load_config(None, [f"{ARO}.actor.policy_loss.loss_mode=kl_cov",
                                    f"{ARO}.actor.policy_loss.kl_cov_ratio=0.002",
                                    f"{ARO}.actor.policy_loss.ppo_kl_coef=1"])
    assert covariance.actor_rollout_ref.actor.policy_loss.kl_cov_ratio == 0.002
    pf_ppo = load_config(None, ["algorithm.use_pf_ppo=True", "algorithm.pf_ppo.reweight_method=pow",
                                "algorithm.pf_ppo.weight_pow=2.0"])
    assert pf_ppo.algorithm.use_pf_ppo and pf_ppo.algorithm.pf_ppo.reweight_method == "pow"
    # verl's Hydra target of the section, at its default, is accepted as the rest of verl's _target_ keys
    load_config(None, [f"{ARO}.actor.policy_loss._target_=verl.workers.config.PolicyLossConfig"])


def test_the_rollout_correction_scripts_lines_load():
    """examples/rollout_correction/run_with_rollout_corr.sh and run_with_rollout_corr_multi_rs.sh."""
    bypass = load_config(None, [f"{CORRECTION}.rollout_is=sequence", f"{CORRECTION}.rollout_is_threshold=2.0",
                                f"{CORRECTION}.rollout_is_batch_normalize=true", f"{CORRECTION}.rollout_rs=null",
                                f"{CORRECTION}.rollout_rs_threshold=null", f"{CORRECTION}.bypass_mode=true",
                                f"{CORRECTION}.loss_type=reinforce", f"{ARO}.rollout.calculate_log_probs=True"])
    assert bypass.algorithm.rollout_correction.bypass_mode
    multi = load_config(None, [f"{CORRECTION}.rollout_is=token", f"{CORRECTION}.rollout_rs='token_k1,seq_max_k2'",
                               f"{CORRECTION}.rollout_rs_threshold='0.6_1.6,2.5'"])
    assert multi.algorithm.rollout_correction.rollout_rs_threshold == "0.6_1.6,2.5"


@pytest.mark.parametrize(("overrides", "records"), [
    ([], False),
    ([f"{ARO}.rollout.calculate_log_probs=true"], True),  # verl's switch: metrics only
    ([f"{CORRECTION}.rollout_is=token"], True),  # without verl's switch: rollout correction asks for them
    ([f"{CORRECTION}.rollout_rs=token_k2", f"{CORRECTION}.rollout_rs_threshold=0.1"], True),
    ([f"{CORRECTION}.bypass_mode=true"], True),
])
def test_the_rollout_records_its_log_probs_when_rollout_correction_needs_them(overrides, records):
    assert load_config(None, overrides).records_rollout_log_probs is records


@pytest.mark.parametrize(("overrides", "key", "phrase"), [
    ([f"{ARO}.actor.policy_loss.loss_mode=bypass_mode"], f"{ARO}.actor.policy_loss.loss_mode",
     "algorithm.rollout_correction.bypass_mode is false"),
    ([f"{ARO}.actor.policy_loss.loss_mode=ppo"], f"{ARO}.actor.policy_loss.loss_mode",
     "allowed: 'vanilla' or 'gspo' or 'sapo' or 'gpg' or 'clip_cov' or 'kl_cov' or 'geo_mean' or 'cispo'"),
    ([f"{CORRECTION}.rollout_rs=token_k4"], f"{CORRECTION}.rollout_rs", "allowed: null, or a comma-separated list"),
    ([f"{CORRECTION}.rollout_rs=seq_mean_k3"], f"{CORRECTION}.rollout_rs_threshold",
     "got null, but rollout_rs is 'seq_mean_k3'"),
    ([f"{CORRECTION}.rollout_rs=seq_mean_k3", f"{CORRECTION}.rollout_rs_threshold='0.5_2.0'"],
     f"{CORRECTION}.rollout_rs_threshold", "only a k1 option takes 'lower_upper'"),
    ([f"{CORRECTION}.rollout_is=geometric"], f"{CORRECTION}.rollout_is", "'token' or 'sequence'"),
    ([f"{CORRECTION}.loss_type=ppo"], f"{CORRECTION}.loss_type", "'ppo_clip' or 'reinforce'"),
    (["algorithm.pf_ppo.reweight_method=top"], "algorithm.pf_ppo.reweight_method", "'pow' or 'max_min'"),
    ([f"{ARO}.actor.tau_neg=0"], f"{ARO}.actor.tau_neg", "a number > 0"),
])
def test_what_verl_rejects_is_one_line_naming_the_key(overrides, key, phrase):
    lines = problems(overrides)
    assert len(lines) == 1 and lines[0].startswith(f"{key}: ") and phrase in lines[0], lines
