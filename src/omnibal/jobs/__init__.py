"""The jobs: what each command computes, as a library call, above the layers it composes.

* :mod:`omnibal.jobs.predict`: the one step-time prediction path (cost table, statistics in the model's units,
  the balancer's cost, micro-batch features) that ``plan``, ``simulate`` and ``balance`` share.
* :mod:`omnibal.jobs.plan_config`, :mod:`omnibal.jobs.plan_job`, :mod:`omnibal.jobs.plan_phases`: ``omnibal plan``:
  what it is asked, the job and its result, and its phases.
* :mod:`omnibal.jobs.hbp`: ``omnibal plan --hbp``.
* :mod:`omnibal.jobs.plan_report` / :mod:`omnibal.jobs.exports`: a plan's report files; its engine exports.
* :mod:`omnibal.jobs.simulate` / :mod:`omnibal.jobs.simulate_plan`: ``omnibal simulate``, and what it takes
  from a plan.
* :mod:`omnibal.jobs.balance`: ``omnibal balance``.
"""
