# flashspec: stand-ins for transformers' export test mixins, whose tests are not run here.


class ExportTesterMixin:
    pass


class ExportGenerateTesterMixin:
    pass
