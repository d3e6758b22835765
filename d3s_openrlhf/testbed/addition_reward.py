"""``reward_func`` of the built-in addition task for ``--reward.remote_url``: the file that
``d3s_openrlhf.tasks.write_reward_file`` writes for ``d3s_openrlhf.tasks.addition``, kept in the package so that runs
that prepare no task directory (the launch-script smoke runs, the end-to-end tests) can name it."""

from d3s_openrlhf.tasks import load_task, reward_func_of

reward_func = reward_func_of(load_task("d3s_openrlhf.tasks.addition"))
