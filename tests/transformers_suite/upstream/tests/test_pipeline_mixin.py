# flashspec: a stand-in for transformers' pipeline test mixin, whose tests are not run here.


class PipelineTesterMixin:
    pass
